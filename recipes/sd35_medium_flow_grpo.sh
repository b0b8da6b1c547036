#!/usr/bin/env bash
# Stable Diffusion 3.5 Medium with the Flow-GRPO hyperparameters: LoRA r32/alpha64 on the joint
# attention's image and text projections (`attn.`: not the image-only `attn2` of SD3.5-M's first
# 13 blocks), lr 3e-4, 10 training steps / 40 evaluation steps, CFG 4.5, noise 0.7, group 24,
# timestep fraction 0.99, clip 1e-4, beta 0.01 (PickScore-style preference reward; Flow-GRPO
# uses 0.04 for GenEval), advantages clipped at 5, and Flow-GRPO's SD3 KL convention (--kl_form
# sde_variance: the KL divided by 2 std_t^2, not by the transition variance). Reward: HPSv3
# (swap in your own with --reward_fn).
set -euo pipefail
cd "$(dirname "$0")/.."
accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes "${NUM_GPUS:-8}" train_genrl.py \
  --pretrained_model_name_or_path stabilityai/stable-diffusion-3.5-medium \
  --prompt_dataset "${PROMPTS:-genrl/assets/prompts/image_prompts.txt}" \
  --reward_fn "hpsv3:1.0" --reward_mode async --reward_device cuda \
  --resolution 512 --num_inference_steps 10 --eval_num_inference_steps 40 \
  --guidance_scale 4.5 --noise_level 0.7 \
  --group_size 24 --rollout_batch_size 12 --rollout_batches_per_epoch 4 \
  --train_batch_size 6 --gradient_accumulation_steps 2 --timestep_fraction 0.99 \
  --clip_range 1e-4 --beta 0.01 --kl_form sde_variance --adv_clip_max 5 \
  --use_lora --rank 32 --lora_alpha 64 --learning_rate 3e-4 --mixed_precision bf16 \
  --lora_target_modules "attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out" \
  --checkpointing_steps 100 --checkpoints_total_limit 3 --eval_steps 100 \
  --output_dir runs/sd35m-flow-grpo "$@"
