"""The accuracy-per-compute benchmark's pure parts: the worked-arithmetic task and its
checker, the pass@k curve, the compute-matched comparison, and the reference Transformer
mapped into a Hugging Face GPT-2 and exported to llama.cpp (GGUF). Nothing here trains or
compiles a graph; the llama.cpp engine test runs only where llama-cpp-python is installed."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from srm_max.rl import worked_arithmetic as wa


def test_generator_is_deterministic_and_distinct():
    a = wa.problems(200, 2, 3, seed=7)
    assert a == wa.problems(200, 2, 3, seed=7)
    assert a != wa.problems(200, 2, 3, seed=8)
    assert len(set(a)) == 200
    for p in a:
        assert all(10 <= x < 1000 for x in (p.a, p.b, p.c))
    held_out = set(a[:50])
    assert not held_out & set(wa.problems(500, 2, 3, seed=1, exclude=held_out))


def test_problem_text_and_worked_answer():
    p = wa.Problem(347, "+", 85, "-", 129)
    assert p.prompt == "\n347+85-129="
    assert p.worked == "347+85=432;432-129=303"
    assert p.line() == "347+85-129=347+85=432;432-129=303\n"
    q = wa.Problem(12, "-", 345, "+", 7)
    assert q.worked == "12-345=-333;-333+7=-326" and q.result == -326
    assert len(p.prompt_ids()) + len(p.target_ids()) <= wa.max_length(3)
    longest = wa.Problem(999, "-", 999, "-", 999)
    assert len(longest.prompt_ids()) + len(longest.target_ids()) <= wa.max_length(3)
    with pytest.raises(ValueError, match="operators"):
        wa.Problem(1, "*", 2, "+", 3)
    with pytest.raises(ValueError, match="min_digits"):
        wa.problems(1, 3, 2)
    with pytest.raises(ValueError, match="distinct problems"):
        wa.problems(10_000, 1, 1)


def test_checker_accepts_right_and_rejects_wrong():
    p = wa.Problem(347, "+", 85, "-", 129)
    right = p.worked + "\n"
    assert p.verify(right) == 1.0
    assert p.verify(wa.encode(right)) == 1.0  # ids, stop token included
    assert p.verify(wa.encode(p.worked)) == 1.0  # ran out of tokens exactly at the answer
    assert p.verify(right + "12+3=15") == 1.0  # what follows the line end is ignored
    assert wa.worked_correct(p, right)
    for wrong in ("347+85=432;432-129=304\n", "347+85=432;432-129=3030\n", "347+85=432;432-129=\n",
                  "347+85=432;432-129=-303\n", "303", "", "\n303", "347+85=432;432-129=0303\n"):
        assert p.verify(wrong) == 0.0, wrong
    # the final answer alone decides; a wrong intermediate step is still caught by worked_correct
    lucky = "347+85=431;431-129=303\n"
    assert p.verify(lucky) == 1.0 and not wa.worked_correct(p, lucky)
    assert p.verify(wa.encode("347+85=432;432-129=") + [3 + 1000]) == 0.0  # an id outside the vocabulary


def test_tokenizer_matches_the_fast_encoder():
    tok = wa.make_tokenizer()
    text = wa.corpus_text(wa.problems(20, 1, 3, seed=3))
    assert tok.encode(text).ids == wa.encode(text)
    assert tok.decode(wa.encode(text)) == text
    assert tok.token_to_id(wa.END_OF_TEXT) == wa.EOT_ID == 0
    assert tok.get_vocab_size() == wa.VOCAB_SIZE == 16
    with pytest.raises(ValueError, match="not in the task's vocabulary"):
        wa.encode("1*2")


def test_pass_at_k_curve_and_compute_matching():
    from bench.accuracy_per_compute import compute_matched, interpolate_log_seconds, pass_at_k_curve

    curve = pass_at_k_curve([0, 3, 10], 10, [1, 2, 5])
    expected = [(0 + (1 - comb(7, k) / comb(10, k)) + 1) / 3 for k in (1, 2, 5)]
    assert curve == pytest.approx(expected)
    assert interpolate_log_seconds([1, 4], [0.2, 0.6], 2) == pytest.approx(0.4)  # log-midpoint
    assert interpolate_log_seconds([1, 4], [0.2, 0.6], 0.5) is None
    assert interpolate_log_seconds([1, 4], [0.2, 0.6], 9) == 0.6
    # a larger k that happened to finish sooner: the envelope keeps the better value
    assert interpolate_log_seconds([1, 2, 4], [0.3, 0.1, 0.6], 2) == pytest.approx(0.3)
    srm = [{"k": 1, "seconds": 1.0, "pass_at_k": 0.2}, {"k": 4, "seconds": 4.0, "pass_at_k": 0.6}]
    tf = [{"k": 1, "seconds": 0.5, "pass_at_k": 0.3}, {"k": 1, "seconds": 2.0, "pass_at_k": 0.25},
          {"k": 2, "seconds": 8.0, "pass_at_k": 0.5}]
    rows = compute_matched(srm, tf)
    assert rows[0]["srm_pass"] is None and rows[0]["relative_gain"] is None
    assert rows[1]["srm_pass"] == pytest.approx(0.4) and rows[1]["relative_gain"] == pytest.approx(0.6)
    assert rows[2]["srm_pass"] == 0.6 and rows[2]["absolute_gain"] == pytest.approx(0.1)


def test_gpt2_mapping_matches_the_reference_transformer():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench import hf_transformer as ht
    from srm_max.reference.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(16, 32, 2, 4, 24, 40)).eval()
    with torch.no_grad():  # biases and norms away from their 0 / 1 initial values
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf = ht.to_gpt2(model)
    ids = torch.randint(0, 16, (3, 24))
    assert ht.max_logit_error(model, hf, ids) < 1e-5
    # a wrong mapping (the MLP's matrices not transposed) is caught
    wrong = ht.gpt2_state_dict(model)
    wrong["transformer.h.0.mlp.c_proj.weight"] = wrong["transformer.h.0.mlp.c_proj.weight"].t().reshape(40, 32)
    hf.load_state_dict(wrong, strict=False)
    assert ht.max_logit_error(model, hf, ids) > 1e-3
    # sampling: completions end at the stop token or at max_new_tokens, one list per prompt and sample
    hf = ht.to_gpt2(model)
    out = ht.sample(hf, [[1, 2, 3], [4, 5], [6, 7, 8]], 3, max_new_tokens=5, temperature=1.0, stop_id=15, seed=0)
    assert [len(o) for o in out] == [3, 3, 3]
    for samples in out:
        for s in samples:
            assert 1 <= len(s) <= 5 and (15 not in s or s.index(15) == len(s) - 1)


def test_kv_cache_decode_matches_the_full_forward_pass():
    torch = pytest.importorskip("torch")
    from bench import kv_decode as kv
    from srm_max.reference.transformer import Transformer, TransformerConfig

    torch.manual_seed(1)
    model = Transformer(TransformerConfig(16, 32, 2, 4, 24, 40)).eval()
    prompt = [3, 1, 4, 1, 5]
    logits = kv.greedy_logits(model, prompt, 8)
    ids = prompt + logits.argmax(-1).tolist()[:-1]
    with torch.no_grad():
        full = model(torch.tensor([ids]))[0, len(prompt) - 1:]
    assert float((full - logits).abs().max() / full.abs().max()) < 1e-5
    out = kv.sample(model, [prompt, [2, 7]], 4, max_new_tokens=6, temperature=1.0, stop_id=15, seed=3)
    assert out == kv.sample(model, [prompt, [2, 7]], 4, max_new_tokens=6, temperature=1.0, stop_id=15, seed=3)
    for samples in out:
        assert len(samples) == 4
        for s in samples:
            assert 1 <= len(s) <= 6 and (15 not in s or s.index(15) == len(s) - 1)
    with pytest.raises(ValueError, match="temperature"):
        kv.sample(model, [prompt], 1, 4, 0.0, 15, 0)


def _tiny_transformer(seed: int):
    """A tiny untrained reference Transformer with its biases and norms moved off 0 / 1."""
    import torch

    from srm_max.reference.transformer import Transformer, TransformerConfig

    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(16, 32, 2, 4, 24, 40)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_gguf_export_holds_every_weight(tmp_path):
    pytest.importorskip("torch")
    gguf = pytest.importorskip("gguf")
    from bench import llama_cpp_transformer as lt

    model = _tiny_transformer(2)
    path = lt.write_gguf(model, tmp_path / "model.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # no temporary left behind
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "gpt2" and meta["tokenizer.ggml.model"] == "none"
    assert {k: meta[f"gpt2.{k}"] for k in ("vocab_size", "context_length", "embedding_length",
                                           "feed_forward_length", "block_count", "attention.head_count")} == {
        "vocab_size": 16, "context_length": 24, "embedding_length": 32, "feed_forward_length": 40,
        "block_count": 2, "attention.head_count": 4}
    assert meta["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    tensors = {t.name: t for t in reader.tensors}
    sd = model.state_dict()
    # llama.cpp's gpt2 loader asks for these ggml shapes (innermost dimension first)
    d, f, V, n = 32, 40, 16, 24
    expected = {"token_embd.weight": ("token_embedding.weight", [d, V]),
                "position_embd.weight": ("position_embedding.weight", [d, n]),
                "output_norm.weight": ("final_norm.weight", [d]), "output_norm.bias": ("final_norm.bias", [d]),
                "output.weight": ("output_layer.weight", [d, V])}
    for i in range(2):
        for theirs, ours, shape_w, shape_b in (("attn_norm", "attn_norm", [d], [d]),
                                               ("attn_qkv", "attn.qkv", [d, 3 * d], [3 * d]),
                                               ("attn_output", "attn.out_proj", [d, d], [d]),
                                               ("ffn_norm", "mlp_norm", [d], [d]), ("ffn_up", "mlp.0", [d, f], [f]),
                                               ("ffn_down", "mlp.2", [f, d], [d])):
            expected[f"blk.{i}.{theirs}.weight"] = (f"blocks.{i}.{ours}.weight", shape_w)
            expected[f"blk.{i}.{theirs}.bias"] = (f"blocks.{i}.{ours}.bias", shape_b)
    assert sorted(tensors) == sorted(expected)
    for name, (ours, shape) in expected.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert [int(x) for x in t.shape] == shape, name
        assert np.array_equal(np.asarray(t.data).reshape(sd[ours].shape), sd[ours].numpy()), name


def test_ggml_gelu_is_the_float16_table_of_the_tanh_approximation():
    torch = pytest.importorskip("torch")
    from bench import llama_cpp_transformer as lt

    x = torch.linspace(-12, 12, 20001)
    got = lt.ggml_gelu(x)
    tanh = torch.nn.functional.gelu(x, approximate="tanh")
    inside = x.abs() < 10
    # within float16 rounding of the tanh GELU inside the table, exact outside it
    assert torch.all((got - tanh).abs()[inside] <= 2e-3 * tanh.abs()[inside] + 2e-3)
    assert torch.equal(got[~inside], torch.where(x[~inside] > 0, x[~inside], torch.zeros_like(x[~inside])))
    assert torch.equal(got[inside], got[inside].half().float())  # every table value is a float16
    assert float((got - torch.nn.functional.gelu(x)).abs().max()) > 1e-4  # not the exact erf GELU


@pytest.mark.parametrize("flash_attn,kv_unified", [(True, True), (False, False)])
def test_llama_cpp_logits_match_the_reference(tmp_path, flash_attn, kv_unified):
    torch = pytest.importorskip("torch")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra (pip install -e '.[llama]')")
    from bench import llama_cpp_transformer as lt

    model = _tiny_transformer(3)
    engine = lt.LlamaCppEngine(lt.write_gguf(model, tmp_path / "model.gguf"), context_length=24, n_seq_max=4,
                               flash_attn=flash_attn, kv_unified=kv_unified)
    try:
        ids = torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(0)).tolist()
        got = torch.from_numpy(engine.logits(ids))
        with torch.no_grad():
            ref = model(torch.tensor([ids]))[0]
            twin = lt.with_ggml_gelu(model)(torch.tensor([ids]))[0]
        rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
        # llama.cpp computes the reference with ggml's GELU, to float32 rounding
        assert rel(got, twin) < 1e-4
        # and differs from the exact-GELU reference by that GELU alone (measured and reported)
        assert 1e-5 < rel(got, ref) < 2e-2
        # sampling: stop tokens cut, reproducible with a seed, more rows than n_seq_max
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
        out = lt.sample(engine, prompts, 3, max_new_tokens=5, temperature=1.0, stop_id=15, seed=0)
        assert out == lt.sample(engine, prompts, 3, 5, 1.0, 15, seed=0)
        assert [len(o) for o in out] == [3, 3, 3]
        for samples in out:
            for s in samples:
                assert 1 <= len(s) <= 5 and (15 not in s or s.index(15) == len(s) - 1)
        # a batch keeps its rows apart: row r's logits equal a lone run's
        prompts = np.array([ids[:6], ids[6:12], ids[12:18]], np.int32)
        engine.clear()
        batched = engine.decode(prompts.reshape(-1), np.tile(np.arange(6, dtype=np.int32), 3),
                                np.repeat(np.arange(3, dtype=np.int32), 6), np.ones(18, np.int8)).reshape(3, 6, 16)
        for r in range(3):
            assert np.allclose(batched[r], engine.logits(prompts[r].tolist()), rtol=1e-4, atol=1e-5)
    finally:
        engine.close()


def test_draw_follows_the_softmax():
    from bench.llama_cpp_transformer import draw

    logits = np.log(np.array([[0.1, 0.2, 0.7, 1e-12], [0.5, 0.5, 1e-12, 1e-12]]))
    rng = np.random.default_rng(0)
    picks = draw(np.repeat(logits, 20_000, axis=0), 1.0, rng).reshape(2, 20_000)
    assert np.allclose(np.bincount(picks[0], minlength=4) / 20_000, [0.1, 0.2, 0.7, 0.0], atol=0.015)
    assert np.allclose(np.bincount(picks[1], minlength=4) / 20_000, [0.5, 0.5, 0.0, 0.0], atol=0.015)
    # temperature sharpens: at T 0.25 the 0.7 token takes 0.7^4 / sum p^4 of the draws
    sharp = draw(np.repeat(logits[:1], 20_000, axis=0), 0.25, rng)
    p4 = np.array([0.1, 0.2, 0.7]) ** 4
    assert abs(np.mean(sharp == 2) - p4[2] / p4.sum()) < 0.015


def test_best_transformer_engine_per_k_takes_every_engine():
    from bench.accuracy_per_compute import best_transformer

    kv = [{"k": 1, "engine": "transformer-kv", "seconds": 1.0}, {"k": 2, "engine": "transformer-kv", "seconds": 5.0}]
    hf = [{"k": 1, "engine": "transformer-hf", "seconds": 2.0}, {"k": 2, "engine": "transformer-hf", "seconds": 3.0}]
    ll = [{"k": 1, "engine": "transformer-llama", "seconds": 0.5},
          {"k": 2, "engine": "transformer-llama", "seconds": 4.0}]
    assert [r["engine"] for r in best_transformer(kv, hf, ll)] == ["transformer-llama", "transformer-hf"]
    assert [r["engine"] for r in best_transformer(kv, hf)] == ["transformer-kv", "transformer-hf"]
    best = best_transformer(kv, hf, ll)
    best[0]["pass_at_k"] = 0.5  # copies: filling in pass@k leaves the engine's own runs alone
    assert "pass_at_k" not in ll[0]
