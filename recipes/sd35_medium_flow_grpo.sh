#!/usr/bin/env bash
# Stable Diffusion 3.5 Medium with Flow-GRPO's published SD3.5-M settings (yifan123/flow_grpo,
# config/grpo.py, pickscore_sd3), laid out for 8 GPUs: 48 groups of 24 images an epoch (each GPU 16
# rollout batches of 9), two optimizer steps an epoch (micro batch 9 x 8), 10 sampling steps with
# SDE noise 0.7 and CFG 4.5 (trained with CFG), independent initial noise per image, 9 trained
# steps per image, advantages over the epoch's standard deviation (global_std) clipped at 5, PPO
# clip 1e-4, KL beta 0.01 (PickScore; Flow-GRPO uses 0.04 for OCR and GenEval) in Flow-GRPO's SD3
# convention (--kl_form sde_variance: divided by 2 std_t^2, not by the transition variance), an
# EMA (decay 0.9 every 8 steps) for evaluation and export, LoRA r32/alpha64 on the joint attention's image and text
# projections (`attn.`: not the image-only `attn2` of SD3.5-M's first 13 blocks), AdamW lr 3e-4,
# weight decay 1e-4, grad norm 1; prompts in 128 T5 tokens; evaluation with 40 steps. Where genrl differs: Flow-GRPO's last
# sampling step is stochastic too and it trains 0.99 of those 10 (9); genrl's last step lands on
# sigma 0 without noise, so all 9 of its stochastic steps are trained (--timestep_fraction 1).
# Reward: PickScore, as pickscore_sd3 (swap in HPSv3 or your own with --reward_fn).
set -euo pipefail
cd "$(dirname "$0")/.."
accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes "${NUM_GPUS:-8}" train_genrl.py \
  --pretrained_model_name_or_path stabilityai/stable-diffusion-3.5-medium \
  --prompt_dataset "${PROMPTS:-genrl/assets/prompts/image_prompts.txt}" \
  --reward_fn "pickscore:1.0" --reward_mode async --reward_device cuda \
  --resolution 512 --num_inference_steps 10 --eval_num_inference_steps 40 --max_sequence_length 128 \
  --guidance_scale 4.5 --noise_level 0.7 --no-same_latent \
  --group_size 24 --rollout_batch_size 9 --rollout_batches_per_epoch 16 \
  --train_batch_size 9 --gradient_accumulation_steps 8 --timestep_fraction 1.0 \
  --clip_range 1e-4 --beta 0.01 --kl_form sde_variance --adv_clip_max 5 --std_mode global \
  --use_lora --rank 32 --lora_alpha 64 \
  --lora_target_modules "attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out" \
  --learning_rate 3e-4 --adam_weight_decay 1e-4 --max_grad_norm 1.0 --mixed_precision bf16 \
  --use_ema --ema_decay 0.9 --ema_update_interval 8 \
  --checkpointing_steps 100 --checkpoints_total_limit 3 --eval_steps 100 \
  --output_dir runs/sd35m-flow-grpo "$@"
