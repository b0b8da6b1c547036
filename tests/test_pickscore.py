"""PickScore on a tiny CLIP saved as the Hub's folders are: preprocessing as upstream's processor
config says, scores equal to CLIP's own forward, videos as the mean of their frames, and one
sentence when the weights cannot be found."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPConfig, CLIPModel

from genrl.data.word_tokenizer import BOS_EOS_TEMPLATE, word_level_tokenizer
from genrl.errors import SetupError
from genrl.rewards import lifecycle
from genrl.rewards.pickscore import build_pickscore_reward, load_pickscore_scorer
from genrl.rewards.registry import build_reward_fn

torch.set_num_threads(2)
SIZE, CROP = 40, 32
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PROMPTS = ["a red circle", "two blue squares", "a green triangle above a red circle"]
# Special tokens first (pad 0, eos 1: CLIP pools at the eos token), then the prompts' words.
VOCAB = ("<pad>", "<eos>", "<unk>", "<bos>", *sorted({w for p in PROMPTS for w in p.split()}))
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(model folder, processor folder)``: a random tiny CLIP, and a tokenizer with a
    preprocessor_config.json in the old feature-extractor form that CLIP repos of that era on the
    Hub carry (integer sizes, ``feature_extractor_type``)."""
    root = tmp_path_factory.mktemp("pickscore")
    text = dict(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=MAX_TOKENS, pad_token_id=0, eos_token_id=1, bos_token_id=3)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=CROP, patch_size=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8, logit_scale_init_value=3.0))
    model.save_pretrained(root / "model")
    processor = root / "processor"
    word_level_tokenizer(VOCAB, MAX_TOKENS, template=BOS_EOS_TEMPLATE).save_pretrained(processor)
    (processor / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": CROP, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": MEAN, "image_std": STD, "resample": 3, "size": SIZE,
    }))
    return str(root / "model"), str(processor)


@pytest.fixture(autouse=True)
def _fresh_cache():
    lifecycle.clear_reward_models()
    yield
    lifecycle.clear_reward_models()


def images(n: int, h: int = 48, w: int = 64, seed: int = 0) -> torch.Tensor:
    """uint8 ``(n, h, w, 3)``: smooth random images (so resampling matters but is stable)."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(n, 3, 6, 8, generator=g)
    return (torch.nn.functional.interpolate(small, size=(h, w), mode="bilinear") * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def test_preprocessing_is_upstream_clip_resize_crop_and_normalise(folders):
    """Independently of transformers: PIL bicubic resize of the shortest side to 40, centre crop to
    32, scale to [0, 1], CLIP mean/std, channels first."""
    scorer = load_pickscore_scorer(*folders)
    frame = images(1)[0].numpy()
    pixels = scorer.image_processor(images=[Image.fromarray(frame)], return_tensors="pt")["pixel_values"][0]
    resized = Image.fromarray(frame).resize((round(64 * SIZE / 48), SIZE), Image.BICUBIC)  # 53 x 40
    left, top = (resized.width - CROP) // 2, (resized.height - CROP) // 2
    crop = np.asarray(resized.crop((left, top, left + CROP, top + CROP)), dtype=np.float32) / 255
    expected = torch.from_numpy((crop - np.array(MEAN, dtype=np.float32)) / np.array(STD, dtype=np.float32)).permute(2, 0, 1)
    torch.testing.assert_close(pixels, expected, rtol=0, atol=1e-5)


def test_scores_are_clips_own_logits_over_26(folders):
    scorer = load_pickscore_scorer(*folders, batch_size=2)  # two batches: the second of one image
    batch = images(3)
    scores = scorer.score_images(batch, PROMPTS)
    model = CLIPModel.from_pretrained(folders[0]).eval()
    pixels = scorer.image_processor(images=[Image.fromarray(f) for f in batch.numpy()], return_tensors="pt")["pixel_values"]
    text = scorer.tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels).logits_per_image
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, logits.diagonal() / 26, rtol=1e-5, atol=1e-6)  # both papers' scale
    assert not torch.allclose(scores, scorer.score_images(batch, PROMPTS[::-1]))  # the prompt matters


def test_the_registry_reward_scores_videos_as_the_mean_of_their_frames(folders):
    options = {"pickscore": {"checkpoint": folders[0], "processor": folders[1]}}
    reward = build_reward_fn("pickscore", options=options)
    frames = images(6, seed=1)  # 3 clips of 2 frames
    clips = frames.reshape(3, 2, 48, 64, 3).permute(0, 4, 1, 2, 3).float() / 255  # (N, C, F, H, W) in [0, 1]
    out = reward(clips, PROMPTS, [{}] * 3)
    scorer = load_pickscore_scorer(*folders)
    per_frame = scorer.score_images(frames, [p for p in PROMPTS for _ in range(2)]).reshape(3, 2)
    torch.testing.assert_close(out["pickscore"], per_frame.mean(dim=1), rtol=1e-5, atol=1e-6)


def test_missing_weights_are_one_sentence_naming_the_repos_and_options(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # An empty Hub cache (read at call time); tests run with HF_HUB_OFFLINE=1.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(SetupError) as error:
        build_pickscore_reward("pickscore")
    message = str(error.value)
    assert "\n" not in message and "yuvalkirstain/PickScore_v1" in message and "laion/CLIP-ViT-H-14" in message
    assert "--reward_options '{\"pickscore\": {\"checkpoint\"" in message
    with pytest.raises(ValueError, match="Reward 'pickscore' takes no option 'pixels'"):
        build_pickscore_reward("pickscore", pixels=224)


@pytest.mark.slow
def test_a_run_trains_against_pickscore_given_local_folders(folders, tiny_sd3, prompt_file, tmp_path):
    """The user's path: --reward_fn pickscore with --reward_options pointing at local folders,
    scored in the async reward thread, logged per epoch."""
    from conftest import run_script

    out = tmp_path / "out"
    options = json.dumps({"pickscore": {"checkpoint": folders[0], "processor": folders[1]}})
    run_script("train_genrl.py", [
        "--pretrained_model_name_or_path", tiny_sd3, "--prompt_dataset", prompt_file, "--reward_fn", "pickscore",
        "--reward_options", options, "--output_dir", str(out), "--group_size", "4", "--rollout_batch_size", "4",
        "--rollout_batches_per_epoch", "1", "--train_batch_size", "4", "--num_inference_steps", "3", "--num_epochs", "2",
        "--report_to", "none"])
    logged = [json.loads(line) for line in open(out / "logs" / "metrics.jsonl") if '"reward/pickscore_mean"' in line]
    # |exp(logit_scale) cos / 26| <= e^3 / 26 for this model: unnormalised embeddings would exceed it.
    assert len(logged) == 2 and all(abs(row["reward/pickscore_mean"]) <= math.exp(3.0) / 26 for row in logged), logged
