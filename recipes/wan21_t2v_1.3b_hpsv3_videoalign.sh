#!/usr/bin/env bash
# Wan2.1-T2V-1.3B, full fine-tuning against HPSv3 (per-frame image quality) and VideoAlign
# (motion quality, text alignment): the GenRL video recipe — 16 steps, CFG 4.5, group 4,
# noise 1.0, one stochastic step drawn in [0, 6), clip 1e-4, no KL, lr 1e-5, EMA 0.9 every 8.
# Reward checkpoints: set HPSV3_* / VIDEOALIGN_* to local folders, or leave the Hub defaults.
# 8 GPUs assumed; swap zero2.yaml for zero3.yaml to shard the weights too.
set -euo pipefail
cd "$(dirname "$0")/.."
accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes "${NUM_GPUS:-8}" train_genrl.py \
  --pretrained_model_name_or_path Wan-AI/Wan2.1-T2V-1.3B-Diffusers \
  --prompt_dataset "${PROMPTS:-genrl/assets/prompts/video_prompts.txt}" \
  --reward_fn "hpsv3:1.0,videoalign_mq:0.5,videoalign_ta:0.5" \
  --reward_options "{\"hpsv3\": {\"checkpoint\": \"${HPSV3_CHECKPOINT:-MizzenAI/HPSv3}\"}, \"videoalign_mq\": {\"checkpoint\": \"${VIDEOALIGN_CHECKPOINT:-KwaiVGI/VideoReward}\"}, \"videoalign_ta\": {\"checkpoint\": \"${VIDEOALIGN_CHECKPOINT:-KwaiVGI/VideoReward}\"}}" \
  --reward_mode sync \
  --height 240 --width 416 --num_frames 33 \
  --num_inference_steps 16 --guidance_scale 4.5 --noise_level 1.0 \
  --sde_window_size 1 --sde_window_range 0 6 \
  --group_size 4 --rollout_batch_size 4 --rollout_batches_per_epoch 4 \
  --train_batch_size 2 --gradient_accumulation_steps 1 \
  --clip_range 1e-4 --beta 0 --adv_clip_max 5 \
  --learning_rate 1e-5 --mixed_precision bf16 --gradient_checkpointing \
  --use_ema --ema_decay 0.9 --ema_update_interval 8 \
  --checkpointing_steps 50 --checkpoints_total_limit 3 --eval_steps 50 \
  --output_dir runs/wan21-1.3b-hpsv3-videoalign "$@"
