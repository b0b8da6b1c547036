#!/usr/bin/env bash
# FLUX.1-dev (guidance-distilled: guidance 3.5 is an input of the model, no true CFG),
# LoRA r32/alpha64 against HPSv3, Flow-GRPO-style settings; ZeRO-3 shards the 12B transformer.
set -euo pipefail
cd "$(dirname "$0")/.."
accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes "${NUM_GPUS:-8}" train_genrl.py \
  --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev \
  --prompt_dataset "${PROMPTS:-genrl/assets/prompts/image_prompts.txt}" \
  --reward_fn "hpsv3:1.0" --reward_mode sync \
  --resolution 512 --num_inference_steps 16 --eval_num_inference_steps 28 \
  --guidance_scale 3.5 --noise_level 0.7 \
  --group_size 16 --rollout_batch_size 8 --rollout_batches_per_epoch 4 \
  --train_batch_size 4 --gradient_accumulation_steps 2 --timestep_fraction 0.6 \
  --clip_range 1e-4 --beta 0.01 --adv_clip_max 5 \
  --use_lora --rank 32 --lora_alpha 64 --learning_rate 1e-4 --mixed_precision bf16 --gradient_checkpointing \
  --checkpointing_steps 100 --checkpoints_total_limit 3 --eval_steps 100 \
  --output_dir runs/flux1-dev-grpo "$@"
