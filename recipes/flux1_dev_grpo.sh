#!/usr/bin/env bash
# FLUX.1-dev with Flow-GRPO's published FLUX settings (yifan123/flow_grpo, config/grpo.py,
# pickscore_flux), laid out for 8 GPUs: 48 groups of 24 images an epoch (each GPU 48 rollout
# batches of 3), two optimizer steps an epoch (micro batch 3 x 24), 6 sampling steps with SDE noise
# 0.9, guidance 3.5 (an input of the guidance-distilled model, no true CFG), independent initial
# noise per image, all 5 stochastic steps trained (Flow-GRPO trains 0.99 of its 6, its last step
# being stochastic too; genrl's lands on sigma 0 without noise), advantages over the epoch's
# standard deviation clipped at 5, PPO clip 1e-4, no KL, an EMA (0.9 every 8 steps) for evaluation
# and export, LoRA r64/alpha128 on the attention projections and the double blocks' feed-forwards
# (Flow-GRPO's train_flux.py list), AdamW lr 3e-4, weight decay 1e-4, grad norm 1; prompts in 128
# T5 tokens; evaluation with 28 steps; PickScore as the reward. genrl adds gradient checkpointing (memory only: the same
# gradients) and ZeRO-3, which shards the frozen 12B base across the GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes "${NUM_GPUS:-8}" train_genrl.py \
  --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev \
  --prompt_dataset "${PROMPTS:-genrl/assets/prompts/image_prompts.txt}" \
  --reward_fn "pickscore:1.0" --reward_mode sync \
  --resolution 512 --num_inference_steps 6 --eval_num_inference_steps 28 --max_sequence_length 128 \
  --guidance_scale 3.5 --noise_level 0.9 --no-same_latent \
  --group_size 24 --rollout_batch_size 3 --rollout_batches_per_epoch 48 \
  --train_batch_size 3 --gradient_accumulation_steps 24 --timestep_fraction 1.0 \
  --clip_range 1e-4 --beta 0 --adv_clip_max 5 --std_mode global \
  --use_lora --rank 64 --lora_alpha 128 \
  --lora_target_modules "attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2" \
  --learning_rate 3e-4 --adam_weight_decay 1e-4 --max_grad_norm 1.0 --mixed_precision bf16 --gradient_checkpointing \
  --use_ema --ema_decay 0.9 --ema_update_interval 8 \
  --checkpointing_steps 60 --checkpoints_total_limit 3 --eval_steps 60 \
  --output_dir runs/flux1-dev-grpo "$@"
