"""VideoAlign scorer on a tiny Qwen2-VL: VideoReward folder layout, LoRA merge, score parity,
normalisation, prompt dependence and frame selection."""

import copy
import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_qwen2vl import VA_TEMPLATE, hf_image_processor, merged, make_tokenizer, save_tiny_videoalign, smooth_images, write_json  # noqa: E402
from _tiny_qwen2vl import VA_NORM as NORM, VA_TOKENS as TOKENS, videoalign_model_config as _model_config  # noqa: E402

from genrl.rewards import lifecycle  # noqa: E402
from genrl.rewards import videoalign as va  # noqa: E402
from genrl.rewards.frame_selection import select_frame_indices  # noqa: E402
from genrl.rewards.qwen2vl_compat import _meta_tensor_names  # noqa: E402
from genrl.rewards.qwen2vl_preprocess import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS  # noqa: E402
from genrl.rewards.registry import build_reward_fn  # noqa: E402

torch.set_num_threads(2)
H, W = 56, 84  # frames kept at this size (a multiple of 28) by the pixel bounds below: no resampling
FAST = {"min_pixels": H * W, "max_pixels": H * W}
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return save_tiny_videoalign(tmp_path_factory.mktemp("videoalign"))


@pytest.fixture(autouse=True)
def empty_cache():
    yield
    lifecycle.clear_reward_models()


def reference_scores(model, tokenizer, frames, prompt, head_outputs=False, template=VA_TEMPLATE):
    """The original VideoAlign forward, written out for frames already chosen and sized:
    video pixel rows assembled from transformers' image processor (frame pairs fill the two
    temporal slots), the chat text by hand, merged video features scattered into the video
    pads, positions arange(L) on all three M-RoPE axes, the linear head at VQ, MQ, TA."""

    processor = hf_image_processor(H * W)
    frames = list(frames) + ([frames[-1]] if len(frames) % 2 else [])
    per_frame = [processor(images=[f.numpy()], return_tensors="pt") for f in frames]
    _, gh, gw = per_frame[0]["image_grid_thw"][0].tolist()
    slices = [out["pixel_values"].float().reshape(gh * gw, 3, 2, 14, 14)[:, :, :1] for out in per_frame]
    pixel_values = torch.cat([torch.cat(slices[i : i + 2], dim=2).reshape(gh * gw, -1) for i in range(0, len(slices), 2)])
    grid = torch.tensor([[len(frames) // 2, gh, gw]])
    pads = "<|video_pad|>" * (int(grid.prod()) // 4)
    user = template.replace("{text_prompt}", prompt)
    chat = f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{user}<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([tokenizer(chat)["input_ids"]])
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(ids)
        embeds[ids == model.config.video_token_id] = merged(model.model.visual(pixel_values, grid_thw=grid))
        positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state[0]
        at = [(ids[0] == tokenizer.convert_tokens_to_ids(t)).nonzero().item() for t in TOKENS]
        logits = model.rm_head(hidden[at].float())  # (3 tokens, output_dim)
        return logits if head_outputs else logits[:, 0]


def _videos(n, frames, seed):
    return smooth_images(n * frames, H, W, seed=seed).reshape(n, frames, H, W, 3)


def test_scores_equal_the_original_forward_on_the_latest_peft_checkpoint(setup):
    scorer = va.load_videoalign_scorer(setup["ckpt"], **FAST)
    assert scorer.config.lora_alpha == 8 and scorer.config.norm["TA"] == (0.25, 4.0)
    videos, prompts = _videos(2, 8, seed=1), ["a boat", "braces {x} }{ {text_prompt}"]
    out = scorer.rewards(videos, prompts, fps=[8.0, 8.0], use_norm=False)
    # 8 frames at 8 fps, 2 sampled per second -> 2, raised to the minimum of 4: round(linspace(0, 7, 4)).
    expected = torch.stack([reference_scores(setup["merged"], setup["tokenizer"], v[[0, 2, 5, 7]], p) for v, p in zip(videos, prompts)])
    got = torch.stack([out["VQ"], out["MQ"], out["TA"]], dim=1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(out["Overall"], got.sum(dim=1))
    assert _meta_tensor_names(scorer.model) == []
    assert scorer.model.lm_head.weight is scorer.model.model.language_model.embed_tokens.weight


def test_normalisation_and_overall_is_the_sum(setup):
    scorer = va.load_videoalign_scorer(setup["ckpt"], **FAST)
    videos = _videos(2, 4, seed=2)
    raw = scorer.rewards(videos, ["p", "q"], fps=[16.0, 16.0], use_norm=False)
    normed = scorer.rewards(videos, ["p", "q"], fps=[16.0, 16.0])
    for dim in ("VQ", "MQ", "TA"):
        torch.testing.assert_close(normed[dim], (raw[dim] - NORM[f"{dim}_mean"]) / NORM[f"{dim}_std"])
    torch.testing.assert_close(normed["Overall"], normed["VQ"] + normed["MQ"] + normed["TA"])
    assert not torch.allclose(normed["Overall"], raw["Overall"])


def test_only_text_alignment_depends_on_the_prompt(setup):
    scorer = va.load_videoalign_scorer(setup["ckpt"], **FAST)
    video = _videos(1, 4, seed=3).expand(2, -1, -1, -1, -1)
    out = scorer.rewards(video, ["a cat on a mat", "a completely different {prompt}"], fps=[16.0, 16.0])
    # Equal up to float noise (the two rows pad to different lengths inside the batch).
    torch.testing.assert_close(out["VQ"][0], out["VQ"][1], rtol=0, atol=1e-5)
    torch.testing.assert_close(out["MQ"][0], out["MQ"][1], rtol=0, atol=1e-5)
    assert (out["TA"][0] - out["TA"][1]).abs() > 1e-4


def test_checkpoint_step_and_plain_layout_give_the_same_model(setup, tmp_path):
    videos = _videos(1, 4, seed=4)
    step20 = va.load_videoalign_scorer(setup["ckpt"], checkpoint_step=20, **FAST).rewards(videos, ["x"], [16.0], use_norm=False)
    expected = reference_scores(setup["original"], setup["tokenizer"], videos[0], "x")
    torch.testing.assert_close(torch.stack([step20[d] for d in ("VQ", "MQ", "TA")], dim=1)[0], expected, rtol=0, atol=1e-5)
    # The merged weights saved plainly (new layout, safetensors) score like the PEFT checkpoint.
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({k: v.contiguous() for k, v in setup["merged"].state_dict().items() if k != "lm_head.weight"}, str(plain / "model.safetensors"))
    config = _model_config(setup["base"])
    config.pop("peft_lora_config")
    write_json(str(plain / "model_config.json"), config)
    got = va.load_videoalign_scorer(str(plain), template_path=str(os.path.join(setup["ckpt"], "prompt_template.json")), **FAST)
    peft = va.load_videoalign_scorer(setup["ckpt"], **FAST)
    a, b = got.rewards(videos, ["x"], [16.0]), peft.rewards(videos, ["x"], [16.0])
    for dim in ("VQ", "MQ", "TA"):
        torch.testing.assert_close(a[dim], b[dim], rtol=0, atol=1e-5)
    assert (a["Overall"] - step20["Overall"]).abs().max() > 1e-4  # the LoRA delta matters
    with pytest.raises(FileNotFoundError, match=r"No checkpoint-7 .* found steps \[20, 100\]"):
        va.load_videoalign_scorer(setup["ckpt"], checkpoint_step=7)


def test_multi_pts_frame_selection_from_the_config(setup, tmp_path):
    folder = tmp_path / "multi"
    (folder / "checkpoint-1").mkdir(parents=True)
    os.link(os.path.join(setup["ckpt"], "checkpoint-20", "model.pth"), str(folder / "checkpoint-1" / "model.pth"))
    write_json(str(folder / "model_config.json"), _model_config(setup["base"], sample_type="multi_pts"))
    scorer = va.load_videoalign_scorer(str(folder), template_path=os.path.join(setup["ckpt"], "prompt_template.json"), **FAST)
    video = _videos(1, 8, seed=5)
    indices = select_frame_indices(8, 8.0, "multi_pts", sample_fps=2.0)
    assert len(indices) == 24
    out = scorer.rewards(video, ["m"], [8.0], use_norm=False)
    expected = reference_scores(setup["original"], setup["tokenizer"], video[0][indices], "m")
    torch.testing.assert_close(torch.stack([out[d] for d in ("VQ", "MQ", "TA")], dim=1)[0], expected, rtol=0, atol=1e-5)


def test_registry_shares_one_model_and_reads_fps_from_metadata(setup, monkeypatch):
    calls = []
    monkeypatch.setattr(va, "select_frame_indices", lambda total, fps, mode, **kw: calls.append((total, fps, mode, kw)) or select_frame_indices(total, fps, mode, **kw))
    options = {"checkpoint": setup["ckpt"], "video_fps": 4.0, **FAST}
    before = len(lifecycle.cached_reward_models())
    reward_fn = build_reward_fn(
        "videoalign_vq:1,videoalign_ta:0.5,videoalign_overall:2",
        options={n: options for n in ("videoalign_vq", "videoalign_ta", "videoalign_overall")},
    )
    assert len(lifecycle.cached_reward_models()) == before + 1
    videos = _videos(2, 6, seed=6)
    samples = videos.permute(0, 4, 1, 2, 3).float() / 255  # (N, C, F, H, W) in [0, 1]
    out = reward_fn(samples, ["one", "two"], [{"fps": 12.0}, {}])
    assert [(c[0], c[1], c[2]) for c in calls] == [(6, 12.0, "uniform"), (6, 4.0, "uniform")]
    assert calls[0][3]["sample_fps"] == 2.0
    scorer = lifecycle.cached_reward_models()[-1]
    direct = scorer.rewards(videos, ["one", "two"], [12.0, 4.0])
    torch.testing.assert_close(out["videoalign_overall"], direct["Overall"])
    torch.testing.assert_close(out["total"], direct["VQ"] + 0.5 * direct["TA"] + 2 * direct["Overall"])
    assert scorer.to("cpu") is scorer and scorer.device == torch.device("cpu")
    with pytest.raises(ValueError, match="Reward 'videoalign_ta' takes no option 'frames'"):
        va.build_videoalign_reward("videoalign_ta", frames=3)


def test_default_pixel_bounds_and_missing_normalisation(setup, tmp_path, caplog):
    folder = tmp_path / "nonorm"
    folder.mkdir()
    config = _model_config(setup["base"])
    config.pop("inference_config")
    write_json(str(folder / "model_config.json"), config)
    os.link(os.path.join(setup["ckpt"], "checkpoint-20", "model.pth"), str(folder / "model.pth"))
    with caplog.at_level("WARNING"):
        scorer = va.load_videoalign_scorer(str(folder), template_path=os.path.join(setup["ckpt"], "prompt_template.json"))
    assert "scores are raw" in caplog.text and scorer.config.norm is None
    assert (scorer.min_pixels, scorer.max_pixels) == (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    video = smooth_images(2, 64, 64, seed=7)[None]  # upsized to at least 128 * 28 * 28 pixels
    raw = scorer.rewards(video, ["z"], [2.0], use_norm=True)
    assert torch.isfinite(raw["Overall"]).all()
    from genrl.rewards.qwen2vl_preprocess import preprocess_clips

    grid = preprocess_clips(video, scorer.spec, min_pixels=scorer.min_pixels, max_pixels=scorer.max_pixels).grid_thw[0]
    assert VIDEO_MIN_PIXELS <= int(grid[1] * grid[2]) * 14 * 14 <= VIDEO_MAX_PIXELS


def test_three_output_head_is_read_on_the_diagonal(setup):
    from _tiny_qwen2vl import CHAT_TEMPLATE

    from genrl.rewards.qwen2vl_preprocess import VisionSpec, template_from_text

    model = copy.deepcopy(setup["original"])
    torch.manual_seed(9)
    model.rm_head = torch.nn.Linear(64, 3, bias=False)
    scorer = va.VideoAlignScorer(
        model, make_tokenizer(TOKENS), CHAT_TEMPLATE, template_from_text(VA_TEMPLATE, "test"), VisionSpec(),
        va.VideoAlignConfig(output_dim=3), "cpu", **FAST,
    )
    video = _videos(1, 4, seed=10)
    got = scorer.score_clips([video[0]], ["d"])[0]
    logits = reference_scores(model, setup["tokenizer"], video[0], "d", head_outputs=True)
    torch.testing.assert_close(got, logits.diagonal(), rtol=0, atol=1e-5)  # VQ from output 0 at VQ, ...


def test_template_must_name_three_tokens(setup, tmp_path):
    bad = write_json(str(tmp_path / "bad.json"), {"template": "{text_prompt} <|VQ_reward|>"})
    with pytest.raises(ValueError, match="three special tokens"):
        va.load_videoalign_scorer(setup["ckpt"], template_path=bad)
    with open(os.path.join(setup["ckpt"], "model_config.json")) as f:
        assert json.load(f)["data_config"]["prompt_template_type"] == "detailed_special"


# The tokens in another order than VA_TEMPLATE's (and upstream's): TA first.
PERMUTED_TEMPLATE = "Fits <|TA_reward|> asked for: {text_prompt} looks <|VQ_reward|> moves <|MQ_reward|>\n"


def _scores(out):
    return torch.stack([out[d] for d in ("VQ", "MQ", "TA")], dim=1)


def _step20_folder(setup, folder, tokenizer=None):
    """A VideoReward folder with the un-adapted weights, optionally saved with its own tokenizer."""
    folder.mkdir()
    os.link(os.path.join(setup["ckpt"], "checkpoint-20", "model.pth"), str(folder / "model.pth"))
    write_json(str(folder / "model_config.json"), _model_config(setup["base"]))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return str(folder)


def test_reward_token_ids_follow_upstream_order_not_the_template(setup, tmp_path):
    template = write_json(str(tmp_path / "permuted.json"), {"template": PERMUTED_TEMPLATE})
    scorer = va.load_videoalign_scorer(setup["ckpt"], checkpoint_step=20, template_path=template, **FAST)
    trained = setup["tokenizer"].convert_tokens_to_ids(list(TOKENS))  # the ids the embeddings were learned under
    assert scorer.reward_token_ids == [scorer.tokenizer.convert_tokens_to_ids(t) for t in TOKENS] == trained
    video = _videos(1, 4, seed=11)
    got = _scores(scorer.rewards(video, ["p"], [16.0], use_norm=False))[0]
    expected = reference_scores(setup["original"], setup["tokenizer"], video[0], "p", template=PERMUTED_TEMPLATE)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_checkpoint_with_its_own_tokenizer_keeps_its_ids(setup, tmp_path):
    own = make_tokenizer(TOKENS[::-1])  # TA, MQ, VQ: ids in the reverse of upstream's order
    folder = _step20_folder(setup, tmp_path / "own", own)
    scorer = va.load_videoalign_scorer(folder, template_path=os.path.join(setup["ckpt"], "prompt_template.json"), **FAST)
    assert scorer.reward_token_ids == own.convert_tokens_to_ids(list(TOKENS)) != setup["tokenizer"].convert_tokens_to_ids(list(TOKENS))
    video = _videos(1, 4, seed=12)
    got = _scores(scorer.rewards(video, ["q"], [16.0], use_norm=False))[0]
    torch.testing.assert_close(got, reference_scores(setup["original"], own, video[0], "q"), rtol=0, atol=1e-5)
    upstream_ids = reference_scores(setup["original"], setup["tokenizer"], video[0], "q")
    assert (got - upstream_ids).abs().max() > 1e-4  # the ids decide the scores


def test_a_checkpoint_tokenizer_without_the_reward_tokens_is_refused(setup, tmp_path):
    folder = _step20_folder(setup, tmp_path / "partial", make_tokenizer(TOKENS[:2]))
    template = os.path.join(setup["ckpt"], "prompt_template.json")
    with pytest.raises(ValueError, match=r"\['<\|TA_reward\|>'\] are not in the checkpoint's tokenizer in .*partial"):
        va.load_videoalign_scorer(folder, template_path=template, **FAST)
    other = write_json(str(tmp_path / "other.json"), {"template": "<|VQ|> <|MQ|> {text_prompt} <|TA|>"})
    with pytest.raises(ValueError, match=r"three special tokens \['<\|VQ_reward\|>'.* names \['<\|VQ\|>'"):
        va.load_videoalign_scorer(setup["ckpt"], template_path=other, **FAST)
