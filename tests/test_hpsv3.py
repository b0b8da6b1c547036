"""HPSv3 scorer on a tiny Qwen2-VL: loading in every layout, score parity with the original forward."""

import hashlib
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_qwen2vl import HPS_TEMPLATE, hf_image_processor, merged, save_tiny_hpsv3, smooth_images, to_old_layout, write_json  # noqa: E402

from genrl.rewards import lifecycle  # noqa: E402
from genrl.rewards.hpsv3 import build_hpsv3_reward, load_hpsv3_scorer, top_fraction_mean  # noqa: E402
from genrl.rewards.qwen2vl_compat import _meta_tensor_names  # noqa: E402
from genrl.rewards.qwen2vl_preprocess import HPSV3_PIXELS  # noqa: E402
from genrl.rewards.registry import build_reward_fn  # noqa: E402

torch.set_num_threads(2)
# smart_resize(448, 448) at HPSv3's 256 * 28 * 28 pixels is 448 x 448: no resampling anywhere.
# One test runs at that budget; the others at 112 x 112 (16 vision tokens) to stay fast.
SIDE, SMALL = 448, 112
FAST = {"pixels": SMALL * SMALL}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return save_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3"))


@pytest.fixture(autouse=True)
def empty_cache():
    yield
    lifecycle.clear_reward_models()


def reference_mu_sigma(model, tokenizer, image, prompt, pixels=HPSV3_PIXELS):
    """The original HPSv3 forward, written out: transformers' image processor, the chat text by
    hand, token embeddings with merged vision features scattered into the image pads, the text
    decoder at positions arange(L) on all three M-RoPE axes, the head at <|Reward|>."""

    processor = hf_image_processor(pixels)
    vision = processor(images=[image.numpy()], return_tensors="pt")
    pads = "<|image_pad|>" * (int(vision["image_grid_thw"].prod()) // 4)
    user = HPS_TEMPLATE.replace("{text_prompt}", prompt)
    chat = f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{user}<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([tokenizer(chat)["input_ids"]])
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(ids)
        features = merged(model.model.visual(vision["pixel_values"].float(), grid_thw=vision["image_grid_thw"]))
        embeds[ids == model.config.image_token_id] = features
        positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        at = (ids[0] == tokenizer.convert_tokens_to_ids("<|Reward|>")).nonzero().item()
        return model.rm_head(hidden[0, at].float())


def test_scores_equal_the_original_forward(setup):
    scorer = load_hpsv3_scorer(setup["ckpt"], setup["base"])  # template found beside the checkpoint
    images = smooth_images(3, SIDE, SIDE, seed=1)
    prompts = ["a red fox", "braces {like} }{ this {text_prompt} {{}}", "a longer prompt about a quiet lake at dawn"]
    got = scorer.score_images(images, prompts)
    expected = torch.stack([reference_mu_sigma(setup["model"], setup["tokenizer"], im, p) for im, p in zip(images, prompts)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert got[:, 0].std() > 1e-3  # the scores depend on the input
    # Batch layout does not change a score (right padding + mask).
    single = torch.cat([scorer.score_images(images[i : i + 1], prompts[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(got, single, rtol=0, atol=1e-5)


def _layouts(setup, tmp_path):
    """The same weights saved in the old, new (wrapped .pth) and sharded layouts."""
    state_dict = setup["model"].state_dict()
    new_path = str(tmp_path / "new.pth")
    torch.save({"model": state_dict}, new_path)
    sharded = str(tmp_path / "sharded")
    setup["model"].save_pretrained(sharded, max_shard_size="60KB")
    return [setup["ckpt"], new_path, sharded]


def test_old_new_and_sharded_checkpoints_give_identical_scores(setup, tmp_path):
    images, prompts = smooth_images(2, SMALL, SMALL, seed=2), ["one", "two"]
    scores = [
        load_hpsv3_scorer(path, setup["base"], template_path=setup["template"], **FAST).score_images(images, prompts)
        for path in _layouts(setup, tmp_path)
    ]
    for other in scores[1:]:
        assert torch.equal(other, scores[0])


def test_peft_lora_checkpoint_scores_like_the_merged_model(setup, tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        copy.deepcopy(setup["model"]),
        LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|up_proj|down_proj)", modules_to_save=["rm_head"]),
    )
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    path = str(tmp_path / "model.pth")
    torch.save(to_old_layout(peft_model.state_dict()), path)
    merged = peft_model.merge_and_unload()
    scorer = load_hpsv3_scorer(path, setup["base"], template_path=setup["template"], **FAST, lora_alpha=8)
    image, prompt = smooth_images(1, SMALL, SMALL, seed=4), ["lora"]
    torch.testing.assert_close(scorer.score_images(image, prompt)[0], reference_mu_sigma(merged, setup["tokenizer"], image[0], prompt[0], SMALL * SMALL), rtol=0, atol=1e-5)
    plain = load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=setup["template"], **FAST).score_images(image, prompt)
    assert (plain - scorer.score_images(image, prompt)).abs().max() > 1e-4  # the LoRA delta was applied


def test_truncated_checkpoint_fails_naming_missing_keys(setup, tmp_path):
    state_dict = to_old_layout(setup["model"].state_dict())
    truncated = {k: v for k, v in state_dict.items() if not k.startswith(("rm_head.5", "model.norm"))}
    path = str(tmp_path / "truncated.safetensors")
    save_file(truncated, path)
    with pytest.raises(ValueError, match=r"3 missing keys \[model.language_model.norm.weight, rm_head.5.bias, rm_head.5.weight\]"):
        load_hpsv3_scorer(path, setup["base"], template_path=setup["template"])


def test_meta_build_matches_normal_build_and_leaves_nothing_on_meta(setup):
    meta = load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=setup["template"], **FAST, on_meta=True)
    normal = load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=setup["template"], **FAST, on_meta=False)
    assert _meta_tensor_names(meta.model) == []
    assert meta.model.rm_head[0].weight.dtype == torch.float32
    images = smooth_images(2, SMALL, SMALL, seed=5)
    torch.testing.assert_close(meta.score_images(images, ["a", "b"]), normal.score_images(images, ["a", "b"]), rtol=0, atol=0)


def test_bfloat16_model_keeps_a_float32_head(setup):
    scorer = load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=setup["template"], **FAST, dtype="bfloat16")
    assert scorer.model.model.language_model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert scorer.model.rm_head[5].weight.dtype == torch.float32
    images = smooth_images(1, SMALL, SMALL, seed=6)
    expected = reference_mu_sigma(setup["model"], setup["tokenizer"], images[0], "p", SMALL * SMALL)
    assert (scorer.score_images(images, ["p"])[0] - expected).abs().max() < 0.1


def test_top30_and_mean_over_frames_via_registry(setup):
    options = {"checkpoint": setup["ckpt"], "base_model": setup["base"], "template_path": setup["template"], **FAST}
    before = len(lifecycle.cached_reward_models())
    reward_fn = build_reward_fn("hpsv3:1.0,hpsv3_top30:0.5", options={"hpsv3": options, "hpsv3_top30": options})
    assert len(lifecycle.cached_reward_models()) == before + 1  # one model for both names
    # What the trainer records in genrl_config.json: the template the scores came from.
    digest = hashlib.sha256(HPS_TEMPLATE.encode("utf-8")).hexdigest()
    assert lifecycle.describe_reward_models() == {"hpsv3": {"template_sha256": digest}}
    frames = smooth_images(2 * 4, SMALL, SMALL, seed=7).reshape(2, 4, SMALL, SMALL, 3)
    samples = frames.permute(0, 4, 1, 2, 3).float() / 255  # the rollout's (N, C, F, H, W) in [0, 1]
    prompts = ["first {video}", "second"]
    out = reward_fn(samples, prompts)
    per_frame = torch.tensor([
        [reference_mu_sigma(setup["model"], setup["tokenizer"], frames[n, f], prompts[n], SMALL * SMALL)[0].item() for f in range(4)] for n in range(2)
    ])
    torch.testing.assert_close(out["hpsv3"], per_frame.mean(dim=1), rtol=0, atol=1e-5)
    top1 = per_frame.max(dim=1).values  # int(0.3 * 4) = 1 frame
    torch.testing.assert_close(out["hpsv3_top30"], top1, rtol=0, atol=1e-5)
    assert (out["hpsv3_top30"] > out["hpsv3"]).all()
    torch.testing.assert_close(out["total"], out["hpsv3"] + 0.5 * out["hpsv3_top30"])


def test_top_fraction_mean_by_hand():
    scores = torch.tensor([[1.0, 5.0, 3.0, 2.0, 4.0, 0.0, 6.0, 7.0, 8.0, 9.0], [2.0] * 10])
    assert top_fraction_mean(scores).tolist() == [8.0, 2.0]  # ceil(0.3 * 10) = 3 best: 9, 8, 7
    assert top_fraction_mean(torch.tensor([[4.0]])).tolist() == [4.0]


def test_scorer_device_moves_with_model_and_rebuilds_after_clear(setup):
    reward = build_hpsv3_reward("hpsv3", "cpu", checkpoint=setup["ckpt"], base_model=setup["base"], template_path=setup["template"], **FAST)
    scorer = lifecycle.cached_reward_models()[-1]
    assert scorer.device == torch.device("cpu")
    image = smooth_images(1, SMALL, SMALL, seed=8)[:, None]  # (N, F, H, W, C) uint8
    first = reward(image, ["x"])["hpsv3"]
    assert scorer.to("cpu") is scorer and scorer.device == torch.device("cpu")
    scorer.to("meta")  # the only other device a CPU machine has
    assert scorer.device == torch.device("meta") and next(scorer.model.parameters()).is_meta
    assert lifecycle.cache_key_of(scorer)[2] == "meta"  # the cache follows the move
    lifecycle.clear_reward_models()  # frees every model before PPO
    torch.testing.assert_close(reward(image, ["x"])["hpsv3"], first)  # rebuilt on next use
    with pytest.raises(ValueError, match="Unknown HPSv3 reward"):
        build_hpsv3_reward("hpsv4")


def test_template_must_name_exactly_one_reward_token(setup, tmp_path):
    bad = write_json(str(tmp_path / "bad.json"), {"template": "{text_prompt} <|A|> <|B|>"})
    with pytest.raises(ValueError, match="one special token"):
        load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=bad)


@pytest.mark.parametrize("frames, kept", [(1, 1), (3, 1), (4, 1), (10, 3), (81, 24)])
def test_top30_keeps_the_published_number_of_frames(frames, kept):
    from genrl.rewards.hpsv3 import top_fraction_mean

    scores = torch.arange(frames, dtype=torch.float32).flip(0).unsqueeze(0)  # frames - 1, ..., 0
    expected = torch.arange(frames - kept, frames, dtype=torch.float32).mean()
    torch.testing.assert_close(top_fraction_mean(scores), expected.unsqueeze(0))


def test_template_hash_is_logged_exposed_and_a_non_upstream_template_warned(setup, tmp_path, caplog, monkeypatch):
    from genrl.rewards import hpsv3

    digest = hashlib.sha256(HPS_TEMPLATE.encode("utf-8")).hexdigest()
    with caplog.at_level("INFO"):
        scorer = load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=setup["template"], **FAST)
    assert scorer.template_sha256 == digest
    assert f"HPSv3 prompt template from {setup['template']}: sha256 {digest[:12]}" in caplog.text
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"(sha256 {digest[:12]}) is not the upstream one" in warned[0]
    # Another template text: another hash. The upstream one: no warning.
    other = write_json(str(tmp_path / "other.json"), {"template": HPS_TEMPLATE.replace("Judge", "Rate")})
    monkeypatch.setattr(hpsv3, "UPSTREAM_TEMPLATE_SHA256", digest)
    caplog.clear()
    with caplog.at_level("INFO"):
        upstream = load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=setup["template"], **FAST)
        forked = load_hpsv3_scorer(setup["ckpt"], setup["base"], template_path=other, **FAST)
    assert upstream.template_sha256 == digest != forked.template_sha256
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and other in warned[0] and forked.template_sha256[:12] in warned[0]
