import inspect
"""Qwen2-VL compatibility layer and in-memory preprocessing (tiny models built here, CPU)."""

import os
import sys
import tempfile

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_qwen2vl import hf_image_processor, hf_smart_resize, make_reward_model, make_tokenizer, smooth_images, tiny_config, to_old_layout  # noqa: E402

from genrl.rewards import qwen2vl_compat as compat  # noqa: E402
from genrl.rewards import qwen2vl_preprocess as prep  # noqa: E402
from genrl.rewards.hpsv3 import build_rank_head  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(["<|Reward|>"])


@pytest.fixture(scope="module")
def model(tok):
    return make_reward_model(build_rank_head(64), len(tok), tok, seed=0)


def _image_inputs(model, tok, text="rate {this}", size=56):
    """One image (size x size) -> (input_ids, mask, pixel_values, grid) with expanded pads."""
    vision = prep.preprocess_clips(
        smooth_images(1, size, size)[:, None], prep.VisionSpec(), min_pixels=size * size, max_pixels=size * size
    )
    pad = "<|image_pad|>" * vision.num_tokens[0]
    chat = f"<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>{text}<|Reward|><|im_end|>\n"
    ids = torch.tensor([tok(chat)["input_ids"]])
    return ids, torch.ones_like(ids), vision.pixel_values, vision.grid_thw


# ----------------------------------------------------------------------------- key layouts


def test_remap_old_keys_to_new_layout_and_is_idempotent():
    old = {
        "visual.patch_embed.proj.weight": torch.zeros(1),
        "model.embed_tokens.weight": torch.zeros(2),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(3),
        "model.norm.weight": torch.zeros(4),
        "lm_head.weight": torch.zeros(5),
        "rm_head.0.weight": torch.zeros(6),
    }
    new = compat.remap_qwen2vl_keys(old)
    assert sorted(new) == sorted([
        "model.visual.patch_embed.proj.weight", "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.mlp.up_proj.weight", "model.language_model.norm.weight",
        "lm_head.weight", "rm_head.0.weight",
    ])
    assert new["model.language_model.norm.weight"] is old["model.norm.weight"]
    assert compat.remap_qwen2vl_keys(new).keys() == new.keys()


def test_remap_peft_layout_and_rejects_mixed_layouts():
    peft = {
        "base_model.model.visual.blocks.0.attn.qkv.weight": torch.zeros(1),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(1),
        "base_model.model.rm_head.weight": torch.zeros(1),
    }
    assert sorted(compat.remap_qwen2vl_keys(peft)) == sorted([
        "base_model.model.model.visual.blocks.0.attn.qkv.weight",
        "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "base_model.model.rm_head.weight",
    ])
    with pytest.raises(ValueError, match="model.language_model.norm.weight"):
        compat.remap_qwen2vl_keys({"model.norm.weight": torch.zeros(1), "model.language_model.norm.weight": torch.zeros(1)})


def _peft_model(model, r=4, alpha=8):
    """A real PEFT LoRA wrapper on every LLM linear (random B, so the merge is not trivial) and
    a saved copy of rm_head, as VideoAlign trained it."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0,
        target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
        modules_to_save=["rm_head"],
    )
    peft_model = get_peft_model(copy.deepcopy(model), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.normal_(0, 0.2)
    return peft_model.eval()


@pytest.mark.parametrize("old_layout", [False, True])
def test_merge_lora_matches_peft_merge_and_unload(model, old_layout):
    peft_model = _peft_model(model)
    state_dict = peft_model.state_dict()
    assert any(".lora_A.default." in k for k in state_dict) and any(".base_layer." in k for k in state_dict)
    if old_layout:
        state_dict = to_old_layout(state_dict)
    merged = compat.normalize_qwen2vl_state_dict(state_dict, lora_alpha=8)
    expected = peft_model.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(merged[key], expected[key], rtol=0, atol=1e-6, msg=key)
    # The merge really changed the LoRA'd weights (and rm_head came from the saved copy).
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], model.state_dict()[q])
    assert not torch.allclose(merged["rm_head.0.weight"], model.state_dict()["rm_head.0.weight"])


def test_merge_lora_needs_alpha_and_checks_rank(model):
    state_dict = _peft_model(model).state_dict()
    with pytest.raises(ValueError, match="lora_alpha"):
        compat.merge_lora_state_dict(state_dict, alpha=None)
    with pytest.raises(ValueError, match="lora_r=8 does not match the rank 4"):
        compat.merge_lora_state_dict(state_dict, alpha=8, r=8)


def test_merge_lora_formula_by_hand():
    w, a, b = torch.randn(3, 5), torch.randn(2, 5), torch.randn(3, 2)
    merged = compat.merge_lora_state_dict(
        {"base_model.model.x.base_layer.weight": w, "base_model.model.x.lora_A.weight": a, "base_model.model.x.lora_B.weight": b},
        alpha=6,
    )
    torch.testing.assert_close(merged["x.weight"], w + 3.0 * b @ a)


# ----------------------------------------------------------------------------- checkpoint files


def test_load_checkpoint_state_dict_file_types_and_shards(model, tmp_path):
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(expected, str(tmp_path / "w.safetensors"))
    torch.save({"model": expected, "step": 3}, str(tmp_path / "w.pth"))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="50KB")
    assert any(n.endswith(".index.json") for n in os.listdir(tmp_path / "sharded"))
    for path in (tmp_path / "w.safetensors", tmp_path / "w.pth", tmp_path / "sharded"):
        loaded = compat.load_checkpoint_state_dict(str(path))
        loaded = compat.normalize_qwen2vl_state_dict(loaded)
        assert set(expected) - {"rm_head.0.weight", "rm_head.0.bias", "rm_head.3.weight", "rm_head.3.bias",
                                "rm_head.5.weight", "rm_head.5.bias"} <= set(loaded), path
        for key in loaded:
            torch.testing.assert_close(loaded[key], expected[key], rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        compat.load_checkpoint_state_dict(str(tmp_path / "nothing"))


# ----------------------------------------------------------------------------- strict loading


def test_strict_load_names_missing_and_unexpected_keys(model, tok):
    target = make_reward_model(build_rank_head(64), len(tok), tok, seed=1)
    state_dict = to_old_layout(model.state_dict())
    truncated = {k: v for k, v in state_dict.items() if not k.startswith("model.layers.1.")}
    truncated["rm_head.9.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as err:
        compat.load_state_dict_strict(target, truncated)
    message = str(err.value)
    assert "model.language_model.layers.1.input_layernorm.weight" in message and "more]" in message
    assert "1 unexpected keys [rm_head.9.weight]" in message
    bad_shape = dict(state_dict, **{"rm_head.5.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'rm_head.5.bias' has shape \(3,\) but the model expects \(2,\)"):
        compat.load_state_dict_strict(target, bad_shape)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_loads_completely_and_matches_normal_build(tok, tie):
    reference = make_reward_model(build_rank_head(64), len(tok), tok, seed=2, tie=tie)
    state_dict = to_old_layout(reference.state_dict())
    if tie:
        state_dict.pop("lm_head.weight")  # tied checkpoints may omit it
    meta = compat.build_qwen2vl_model(tiny_config(len(tok), tok, tie=tie), on_meta=True, dtype=torch.float32)
    with torch.device("meta"):
        meta.rm_head = build_rank_head(64)
    assert compat._meta_tensor_names(meta)
    compat.load_state_dict_strict(meta, state_dict)
    assert compat._meta_tensor_names(meta) == []
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(dict(meta.named_buffers())[name], buf, rtol=0, atol=0, msg=name)
    if tie:
        assert meta.lm_head.weight is meta.model.language_model.embed_tokens.weight
    ids, mask, pixels, grid = _image_inputs(reference, tok)
    expected = compat.reward_hidden_states(reference, ids, mask, pixel_values=pixels, image_grid_thw=grid)
    got = compat.reward_hidden_states(meta, ids, mask, pixel_values=pixels, image_grid_thw=grid)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_meta_tensor_that_cannot_be_rebuilt_is_named(model, tok):
    meta = compat.build_qwen2vl_model(tiny_config(len(tok), tok), on_meta=True, dtype=torch.float32)
    with torch.device("meta"):
        meta.rm_head = build_rank_head(64)
        meta.rm_head.register_buffer("scale", torch.ones(2), persistent=False)  # no config to rebuild it from
    with pytest.raises(ValueError, match=r"still on the meta device after loading: \[rm_head.scale\]"):
        compat.load_state_dict_strict(meta, model.state_dict())


# ----------------------------------------------------------------------------- runtime compatibility


def test_alias_embed_tokens_adds_no_parameters_modules_or_keys(tok):
    model = make_reward_model(build_rank_head(64), len(tok), tok)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    modules = [n for n, _ in model.named_modules(remove_duplicate=False)]
    keys = list(model.state_dict())
    compat.alias_embed_tokens(model)
    assert model.model.embed_tokens is model.model.language_model.embed_tokens
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == names
    assert [n for n, _ in model.named_modules(remove_duplicate=False)] == modules
    assert list(model.state_dict()) == keys and "model.embed_tokens.weight" not in keys
    assert len(names) == len(set(names))
    compat.alias_embed_tokens(model)  # twice is harmless
    assert list(model.state_dict()) == keys


def test_vision_features_reads_pooler_output(model, tok):
    ids, mask, pixels, grid = _image_inputs(model, tok)
    output = model.model.visual(pixels, grid_thw=grid)
    merged = compat.vision_features(output)
    # Merged rows = patches / merge**2, in the text width; pre-merger rows keep the vision width.
    assert merged.shape == (int(grid.prod()) // 4, 64)
    if isinstance(output, torch.Tensor):  # transformers 4.x returns the merged tensor itself
        assert merged is output
    else:
        assert output.last_hidden_state.shape == (int(grid.prod()), 32)
    assert compat.vision_features(merged) is merged


def test_reward_forward_fails_if_pre_merger_features_were_scattered(model, tok, monkeypatch):
    ids, mask, pixels, grid = _image_inputs(model, tok)
    if isinstance(model.model.visual(pixels, grid_thw=grid), torch.Tensor):
        pytest.skip("transformers 4.x: the vision tower returns only the merged features")
    monkeypatch.setattr(compat, "vision_features", lambda out: out.last_hidden_state)
    with pytest.raises(ValueError, match="image pad tokens but the vision tower gave"):
        compat.reward_hidden_states(model, ids, mask, pixel_values=pixels, image_grid_thw=grid)


def test_reward_forward_equals_hf_forward_with_sequential_positions_not_mrope(model, tok):
    ids, mask, pixels, grid = _image_inputs(model, tok)
    ours = compat.reward_hidden_states(model, ids, mask, pixel_values=pixels, image_grid_thw=grid)
    # transformers' own embedding + scatter path, told to use positions arange(L) on all 3 axes.
    positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    hf = model.model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid, position_ids=positions)
    torch.testing.assert_close(ours, hf.last_hidden_state, rtol=0, atol=1e-5)
    # 5.x needs the token types to build M-RoPE positions; 4.x derives them from the ids.
    extra = {}
    if "mm_token_type_ids" in inspect.signature(model.model.forward).parameters:
        extra["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    mrope = model.model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid, **extra)
    assert (ours - mrope.last_hidden_state).abs().max() > 1e-3  # the positions matter


def test_zero3_init_disabled_hides_an_active_zero3_config():
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    ds_config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        with compat.zero3_init_disabled():
            assert not is_deepspeed_zero3_enabled()
            tok = make_tokenizer()
            built = compat.build_qwen2vl_model(tiny_config(len(tok), tok), on_meta=False, dtype=torch.float32)
        assert is_deepspeed_zero3_enabled()
        assert not any(hasattr(p, "ds_id") for p in built.parameters())
        built = compat.build_qwen2vl_model(tiny_config(len(tok), tok), on_meta=True, dtype=torch.float32)
        assert is_deepspeed_zero3_enabled()  # restored after the builder's own use of the context
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        del ds_config


# ----------------------------------------------------------------------------- preprocessing


def test_smart_resize_matches_transformers_and_respects_bounds():
    smart_resize = hf_smart_resize()

    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(20, 2000, 2))
        for lo, hi in ((prep.HPSV3_PIXELS, prep.HPSV3_PIXELS), (prep.VIDEO_MIN_PIXELS, prep.VIDEO_MAX_PIXELS)):
            rh, rw = prep.smart_resize(h, w, 28, lo, hi)
            try:
                expected = smart_resize(h, w, 28, lo, hi)
            except ValueError:  # transformers 4.x refuses sides below the factor; 5.x and genrl take them
                continue
            assert (rh, rw) == expected
            assert rh % 28 == 0 and rw % 28 == 0
            rounded = round(h / 28) * round(w / 28) * 28 * 28
            if rounded > hi:  # shrunk: never above the budget
                assert rh * rw <= hi
            elif rounded < lo:  # grown: never below the floor
                assert rh * rw >= lo
            else:
                assert lo <= rh * rw <= hi
    with pytest.raises(ValueError, match="aspect ratio"):
        prep.smart_resize(10, 3000)


def _hf_image_processor(pixels):

    return hf_image_processor(pixels)


def test_patchify_equals_transformers_processor_exactly_on_presized_images():
    images = smooth_images(2, 56, 84, seed=3)
    ours = prep.preprocess_clips(images[:, None], prep.VisionSpec(), min_pixels=56 * 84, max_pixels=56 * 84)
    hf = _hf_image_processor(56 * 84)(images=list(images.numpy()), return_tensors="pt")
    assert ours.grid_thw.tolist() == hf["image_grid_thw"].tolist() == [[1, 4, 6]] * 2
    torch.testing.assert_close(ours.pixel_values, hf["pixel_values"].float(), rtol=0, atol=1e-6)
    assert ours.num_tokens == [6, 6]


def test_resize_close_to_transformers_processor_at_hpsv3_budget():
    images = smooth_images(1, 100, 150, seed=4)
    ours = prep.preprocess_clips(images[:, None], prep.VisionSpec(), min_pixels=prep.HPSV3_PIXELS, max_pixels=prep.HPSV3_PIXELS)
    hf = _hf_image_processor(prep.HPSV3_PIXELS)(images=list(images.numpy()), return_tensors="pt")
    gt, gh, gw = ours.grid_thw[0].tolist()
    assert ours.grid_thw.tolist() == hf["image_grid_thw"].tolist()
    assert (gh * 14, gw * 14) == prep.smart_resize(100, 150, 28, prep.HPSV3_PIXELS, prep.HPSV3_PIXELS) == (392, 560)
    step = 1 / 255 / min(prep.OPENAI_CLIP_STD)  # one uint8 level after normalisation
    diff = (ours.pixel_values - hf["pixel_values"].float()).abs()
    # CPU uint8 frames take torch's fixed-point uint8 kernel, like PIL's: rare 2-level differences.
    assert diff.max() <= 2.01 * step and diff.mean() < 0.05 * step
    # The float32 path (GPU frames) rounds once at the end; PIL rounds between its two passes.
    spec = prep.VisionSpec()
    as_float = prep.patchify(prep.normalize_frames(prep.resize_frames(images.permute(0, 3, 1, 2).float(), 392, 560), spec), spec)[0]
    diff = (as_float - hf["pixel_values"].float()).abs()
    assert diff.max() <= 1.01 * step and diff.mean() < 0.35 * step


def test_video_patchify_pads_with_last_frame_and_orders_c_t_p_p():
    spec = prep.VisionSpec()
    frames = smooth_images(3, 56, 56, seed=5)  # 3 frames: padded to 4 with a copy of frame 2
    video = prep.preprocess_clips(frames[None], spec, min_pixels=56 * 56, max_pixels=56 * 56)
    assert video.grid_thw.tolist() == [[2, 4, 4]] and video.num_tokens == [8]
    patches = video.pixel_values.reshape(2, 16, 3, 2, 14, 14)  # (gt, patches, C, t, P, P)
    normalized = prep.normalize_frames(frames.permute(0, 3, 1, 2).float(), spec)
    # The first patch row of temporal slot (gt=1, t=0) is the top-left 14x14 of frame 2 ...
    torch.testing.assert_close(patches[1, 0, :, 0], normalized[2, :, :14, :14])
    # ... and its t=1 slice is the padded copy of frame 2.
    torch.testing.assert_close(patches[1, 0, :, 1], normalized[2, :, :14, :14])
    # Row 1 is the patch right of it inside the first 2x2 merge block; row 2 the one below.
    torch.testing.assert_close(patches[0, 1, :, 1], normalized[1, :, :14, 14:28])
    torch.testing.assert_close(patches[0, 2, :, 0], normalized[0, :, 14:28, :14])
    # A still video of two identical frames equals the image processor's output for the image.
    still = prep.preprocess_clips(frames[:1].expand(2, -1, -1, -1)[None], spec, min_pixels=56 * 56, max_pixels=56 * 56)
    hf = _hf_image_processor(56 * 56)(images=[frames[0].numpy()], return_tensors="pt")
    torch.testing.assert_close(still.pixel_values, hf["pixel_values"].float(), rtol=0, atol=1e-6)


def test_video_frames_between_videoalign_pixel_bounds():
    for h, w in ((480, 832), (64, 64), (1080, 1920)):
        rh, rw = prep.smart_resize(h, w, 28, prep.VIDEO_MIN_PIXELS, prep.VIDEO_MAX_PIXELS)
        assert prep.VIDEO_MIN_PIXELS <= rh * rw <= prep.VIDEO_MAX_PIXELS


def test_preprocessing_writes_no_files(monkeypatch, tmp_path):
    import cv2

    def forbidden(*args, **kwargs):
        raise AssertionError("preprocessing must not touch the file system")

    for name in ("imwrite", "VideoWriter", "imencode"):
        monkeypatch.setattr(cv2, name, forbidden)
    for name in ("mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory"):
        monkeypatch.setattr(tempfile, name, forbidden)
    # A temporary folder of this test's own: other processes (the other test worker) write to /tmp.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    prep.preprocess_clips(smooth_images(5, 60, 90)[None], prep.VisionSpec(),
                          min_pixels=prep.VIDEO_MIN_PIXELS, max_pixels=prep.VIDEO_MAX_PIXELS)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- templates


def test_fill_template_inserts_braces_verbatim():
    assert prep.fill_template("A {text_prompt} B {{x}}", "{0} {text_prompt} }{") == "A {0} {text_prompt} }{ B {x}"
    with pytest.raises(ValueError, match="field {other}"):
        prep.fill_template("{other}", "p")


def test_template_files_json_text_and_module_read_as_text(tmp_path):
    (tmp_path / "t.json").write_text('{"template": "Q {text_prompt} <|A|> <|B|>", "special_tokens": ["<|B|>", "<|A|>"]}')
    assert prep.read_template_file(str(tmp_path / "t.json"), ()).special_tokens == ("<|B|>", "<|A|>")
    (tmp_path / "t.txt").write_text("Q {text_prompt} <|A|> then <|B|>")
    assert prep.read_template_file(str(tmp_path / "t.txt"), ()).special_tokens == ("<|A|>", "<|B|>")
    # An "installed" upstream package whose import would fail: it must be read, never imported.
    package = tmp_path / "site" / "fakeupstream"
    (package / "dataset").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "dataset" / "prompts.py").write_text('import nothing_here\nHEAD = "Rate {text_prompt}."\nTAIL = " <|R|>"\n')
    sys.path.insert(0, str(tmp_path / "site"))
    try:
        template = prep.resolve_prompt_template(None, [str(tmp_path / "empty")], [("fakeupstream", "dataset/prompts.py")], ("HEAD", "TAIL"))
    finally:
        sys.path.remove(str(tmp_path / "site"))
    assert template.text == "Rate {text_prompt}. <|R|>" and template.special_tokens == ("<|R|>",)
    assert "fakeupstream" not in sys.modules
    with pytest.raises(FileNotFoundError, match="template_path"):
        prep.resolve_prompt_template(None, [str(tmp_path)], [("no_such_pkg_xyz", "p.py")], ("HEAD",))
    with pytest.raises(ValueError, match="no special reward token"):
        prep.template_from_text("plain {text_prompt}", "test")


def test_reward_tokens_must_fit_the_checkpoint_vocabulary():
    tokenizer = make_tokenizer()
    ids = prep.add_special_tokens(tokenizer, ["<|Reward|>"], vocab_size=len(tokenizer) + 1)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|Reward|>"]
    with pytest.raises(ValueError, match="outside the checkpoint's vocabulary"):
        prep.add_special_tokens(make_tokenizer(), ["<|VQ|>", "<|MQ|>", "<|TA|>"], vocab_size=3)
