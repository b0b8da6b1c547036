#!/usr/bin/env bash
# Stable Diffusion 3.5 Medium with DiffusionNFT's published settings (NVlabs/DiffusionNFT,
# config/nft.py, the 8-GPU SD3 configs): CFG-free deterministic rollouts of 10 steps (genrl's
# second-order multistep solver, ab2, where the paper's code uses multistep DPM-Solver-2; both take
# one model call a step), 48 groups of 24 images an epoch (each GPU 16 rollout batches of 9), one
# optimizer step an epoch (micro batch 9 x 16), 9 of the 10 sampling steps trained per image, NFT
# beta 1, advantages over the epoch's standard deviation clipped at 5, KL 1e-4 to the base (on the
# velocities), the sampling policy soft-updated (eta = min(0.001 step, 0.5)), an EMA of the LoRA
# (decay 0.9 every step) for evaluation and export, LoRA r32/alpha64 on the joint attention's
# image and text projections (`attn.`: not the image-only `attn2` of SD3.5-M's first 13 blocks),
# lr 3e-4, prompts in 128 T5 tokens. Evaluation: 40 steps, CFG-free (the paper's with Euler
# steps, genrl's with the rollouts' solver). Reward: PickScore, as its sd3_pickscore config (the
# paper also trains HPSv2, OCR and GenEval; swap in HPSv3 or your own with --reward_fn). An epoch
# draws 48 prompts: point PROMPTS at a real prompt set (the paper's PickScore split has about
# 25k); the shipped 16-prompt sample repeats each prompt three times an epoch, and the trainer
# says so.
set -euo pipefail
cd "$(dirname "$0")/.."
accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes "${NUM_GPUS:-8}" train_genrl.py \
  --pretrained_model_name_or_path stabilityai/stable-diffusion-3.5-medium \
  --prompt_dataset "${PROMPTS:-genrl/assets/prompts/image_prompts.txt}" \
  --reward_fn "pickscore:1.0" --reward_mode async --reward_device cuda \
  --objective nft --nft_beta 1.0 --beta 1e-4 --adv_clip_max 5 --std_mode global \
  --sampling_policy_decay_rate 0.001 --sampling_policy_decay_max 0.5 \
  --resolution 512 --num_inference_steps 10 --eval_num_inference_steps 40 --max_sequence_length 128 \
  --guidance_scale 1.0 --noise_level 0 --no-same_latent --ode_solver ab2 \
  --group_size 24 --rollout_batch_size 9 --rollout_batches_per_epoch 16 \
  --train_batch_size 9 --gradient_accumulation_steps 16 --timestep_fraction 0.9 \
  --use_lora --rank 32 --lora_alpha 64 \
  --lora_target_modules "attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out" \
  --learning_rate 3e-4 --max_grad_norm 1.0 --mixed_precision bf16 \
  --use_ema --ema_decay 0.9 --ema_update_interval 1 \
  --checkpointing_steps 30 --checkpoints_total_limit 3 --eval_steps 10 \
  --output_dir runs/sd35m-diffusionnft "$@"
