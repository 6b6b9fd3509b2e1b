"""benchmarks/bench_peers.py and tools/known_kernels_page.py on the CPU, with fake peers.

The real peers need an H200; here every peer module is a fake that computes what a correct kernel
of its convention returns (`dsa_ref.oracle.reference_kernel` and the readable functions), at tiny
sizes. So every adapter of `bench_peers.IMPLS` runs: its conversions into the peer's layout and
sentinel, its call, and its oracle check, which must say ``ok`` for a faithful fake, name the
peer's convention facts (``+inf`` LSE on FlashMLA's empty rows, NaN outputs from TileLang's, keys
dropped by TileLang's simple kernel, whose queries sit at positions ``0..T-1``), and say
``mismatch`` for a fake with a planted bug. No timing is asserted anywhere.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

import bench_peers as bp  # noqa: E402
import known_kernels_page as page  # noqa: E402

from dsa_ref import attention_head_sum, index_scores_at, lightning_indexer, sparse_mla  # noqa: E402
from dsa_ref.indexer_loss import indexer_loss_on_slots  # noqa: E402
from dsa_ref.oracle import CONVENTIONS, reference_kernel, to_reference_indices  # noqa: E402

CPU = torch.device("cpu")
SHAPE = bp.Shape(16, 32, "causal")  # q_start = 16: TileLang's simple kernel misplaces these queries
SQUARE = bp.Shape(16, 16, "causal")  # q_start = 0: every kernel places them right


def inputs(shape=SHAPE):
    return bp.Inputs(shape, bp.TINY, device=CPU)


# ------------------------------------------------------------------------------------------ fake peers


def _fake_forward(convention, q_start=0):
    """A sparse-MLA forward that returns what a correct kernel of ``convention`` returns."""
    def fwd(q, kv, indices, sm_scale, d_v):
        return reference_kernel(q, kv, indices, convention=CONVENTIONS[convention], sm_scale=sm_scale, d_v=d_v,
                                q_start=q_start)
    return fwd


def _thd_grads(q, kv, ref_idx, d_out, sm_scale, d_v):
    """dq, dkv of the reference (float64 autograd) in q's and kv's dtypes; THD, kv ``[N, D]``."""
    q64 = q.detach().double().requires_grad_(True)
    kv64 = kv.detach().double().requires_grad_(True)
    with torch.enable_grad():
        out, _ = sparse_mla(q64, kv64, ref_idx, sm_scale=sm_scale, d_v=d_v)
        dq, dkv = torch.autograd.grad(out, (q64, kv64), d_out.double())
    return dq.to(q.dtype), dkv.to(kv.dtype)


def _dim_v(q):
    """The value width of a call that does not pass one (TileLang's pipelined kernel: 512)."""
    return bp.TINY.dim_v if q.shape[-1] == bp.TINY.dim else 512


def fake_flashmla(empty_lse=float("inf")):
    """FlashMLA's binding; ``empty_lse`` is what it writes on rows with no valid slot (correct: +inf)."""
    def sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
        assert attn_sink is None and topk_length is None and indices.dtype == torch.int32
        out, lse = _fake_forward("flashmla_sparse_prefill")(q, kv, indices, sm_scale, d_v)
        lse = torch.where(torch.isinf(lse), torch.full_like(lse, empty_lse), lse)
        return [out, lse.abs(), lse]  # out, max_logits (a stand-in), lse
    return SimpleNamespace(sparse_prefill_fwd=sparse_prefill_fwd)


def fake_megatron_modules():
    conv = "megatron_tilelang_ops"

    def sparse_mla_fwd_interface(q, kv, indices, sm_scale=None, d_v=512):
        assert q.dim() == 3 and kv.dim() == 3 and indices.dim() == 3 and indices.dtype == torch.int32
        return _fake_forward(conv)(q, kv, indices, sm_scale, d_v)

    def sparse_mla_bwd(q, kv, o, do, indices, lse, sm_scale=None, delta=None):
        ref = to_reference_indices(indices, CONVENTIONS[conv], num_keys=kv.shape[0])
        dq, dkv = _thd_grads(q, kv[:, 0], ref, do, sm_scale, do.shape[-1])
        return dq, dkv[:, None, :]

    def indexer_fwd_interface(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True, use_relu=True):
        assert cu_seqlen_ks.dtype == torch.int32
        return lightning_indexer(q.double(), kv.double(), weights.double(), starts=cu_seqlen_ks.long(),
                                 ends=cu_seqlen_ke.long(), relu=use_relu).float()

    def indexer_bwd_interface(index_q, weights, index_k, topk_indices, grad_scores, use_relu=True):
        q, k, w = (t.detach().double().requires_grad_(True) for t in (index_q, index_k, weights))
        with torch.enable_grad():
            s = index_scores_at(q, k, w, topk_indices.long(), relu=use_relu)
            g = torch.where(torch.isfinite(s), grad_scores.double(), torch.zeros_like(s))
            dq, dk, dw = torch.autograd.grad(s, (q, k, w), g)
        return dq.to(index_q.dtype), dw.float(), dk.to(index_k.dtype)  # Megatron's order: q, w, k

    def sparse_indexer_target_interface(query, key, topk_indices, softmax_scale):
        idx = topk_indices.long()
        _, lse = sparse_mla(query.double(), key.double(), idx, sm_scale=softmax_scale, d_v=key.shape[1])
        return attention_head_sum(query.double(), key.double(), idx, lse, sm_scale=softmax_scale).float()

    def sparse_indexer_kl_interface(target, index_logits, valid_mask):
        logits = index_logits.double().requires_grad_(True)
        with torch.enable_grad():
            loss = indexer_loss_on_slots(logits, target.double(), valid_mask, reduction="sum")
            (grad,) = torch.autograd.grad(loss, logits)
        return loss.float(), grad.float()

    class SparseIndexerKLLoss(torch.autograd.Function):  # Megatron's bridge: saves the gradient, scales it
        @staticmethod
        def forward(ctx, target, index_logits, valid_mask):
            kl_sum, grad_logits = sparse_indexer_kl_interface(target, index_logits, valid_mask)
            ctx.save_for_backward(grad_logits)
            return kl_sum

        @staticmethod
        def backward(ctx, grad_output):
            (grad_logits,) = ctx.saved_tensors
            return None, grad_logits * grad_output, None

    return {
        "tilelang_sparse_mla_fwd": SimpleNamespace(sparse_mla_fwd_interface=sparse_mla_fwd_interface),
        "tilelang_sparse_mla_bwd": SimpleNamespace(sparse_mla_bwd=sparse_mla_bwd),
        "tilelang_indexer_fwd": SimpleNamespace(indexer_fwd_interface=indexer_fwd_interface),
        "tilelang_indexer_bwd": SimpleNamespace(indexer_bwd_interface=indexer_bwd_interface),
        "tilelang_indexer_loss": SimpleNamespace(sparse_indexer_target_interface=sparse_indexer_target_interface,
                                                 sparse_indexer_kl_interface=sparse_indexer_kl_interface,
                                                 SparseIndexerKLLoss=SparseIndexerKLLoss),
    }


def fake_tilelang_modules():
    conv = "tilelang_deepseek_v32"

    def simple_interface(q, kv, indices, sm_scale=None, return_p_sum=False, d_v=512, **_):
        assert q.dim() == 4 and kv.dim() == 4 and (indices >= 0).all(), "TileLang pads with S, never -1"
        return _fake_forward(conv, q_start=0)(q, kv, indices, sm_scale, d_v)  # position = row of q

    def pipelined_interface(q, kv, indices, q_start_index_s, kv_stride, sm_scale=None, is_casual=True,
                            return_kernel=False, print_kernel=False):
        assert kv_stride == 1

        def kernel(q_, kv_, idx_, q_start_t):
            return _fake_forward(conv, q_start=int(q_start_t[0]))(q_, kv_, idx_, sm_scale, _dim_v(q_))
        if return_kernel:
            return kernel
        return kernel(q, kv, indices, torch.tensor([q_start_index_s]))

    def sparse_mla_bwd(q, kv, o, do, indices, lse, sm_scale=None, is_casual=True, return_kernel=False, delta=None):
        ref = to_reference_indices(indices, CONVENTIONS[conv], num_keys=kv.shape[1], q_start=0)
        dq, dkv = _thd_grads(q[0], kv[0, :, 0], ref, do[0], sm_scale, do.shape[-1])
        return dq[None], dkv[None, :, None, :]

    def mqa_attn_return_logits_interface(q, kv, kv_scales, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True):
        assert q.dtype == torch.float8_e4m3fn and kv.dtype == torch.float8_e4m3fn
        k = kv.double() * kv_scales.double()[:, None]
        return lightning_indexer(q.double(), k, weights.double(), starts=cu_seqlen_ks.long(),
                                 ends=cu_seqlen_ke.long()).float()

    def per_custom_dims_cast_to_fp8(x, dims, use_ue8m0):
        sf = x.abs().float().amax(dim=1, keepdim=True).clamp(1e-4) / 448.0
        return (x * (1.0 / sf)).to(torch.float8_e4m3fn), sf.squeeze()

    return {
        "sparse_mla_fwd": SimpleNamespace(sparse_mla_fwd_interface=simple_interface),
        "sparse_mla_fwd_pipelined": SimpleNamespace(sparse_mla_fwd_interface=pipelined_interface),
        "sparse_mla_bwd": SimpleNamespace(sparse_mla_bwd=sparse_mla_bwd),
        "fp8_lighting_indexer": SimpleNamespace(mqa_attn_return_logits_interface=mqa_attn_return_logits_interface),
        "utils": SimpleNamespace(per_custom_dims_cast_to_fp8=per_custom_dims_cast_to_fp8),
    }


def _reference_slot_kl(scores, mass, valid):
    """``(kl_sum, d_scores)`` as `slot_kl_tilelang` returns them, from the reference under autograd."""
    with torch.enable_grad():
        s = scores.detach().requires_grad_(True)
        loss = indexer_loss_on_slots(s, mass, valid, reduction="sum")
        (grad,) = torch.autograd.grad(loss, s)
    return loss.detach(), grad


@pytest.fixture
def fake_dsa_ref_kernels(monkeypatch):
    """dsa_ref's kernel modules -> stand-ins that call the readable reference (the real ones need
    tilelang and CUDA). The adapters import their entry points when they run, so they find these."""
    fakes = {
        "dsa_ref.kernels.autograd": SimpleNamespace(
            sparse_mla_tilelang=lambda q, kv, idx, *, sm_scale, d_v=512, **_: sparse_mla(q, kv, idx, sm_scale=sm_scale,
                                                                                            d_v=d_v),
            lightning_indexer_tilelang=lambda q, k, w, **kw: lightning_indexer(q, k, w, **kw)),
        "dsa_ref.kernels.indexer_bwd": SimpleNamespace(
            index_scores_at_tilelang=lambda q, k, w, idx, **kw: index_scores_at(q, k, w, idx, **kw)),
        "dsa_ref.kernels.attention_target": SimpleNamespace(attention_head_sum_tilelang=attention_head_sum),
        "dsa_ref.kernels.indexer_loss_slots": SimpleNamespace(indexer_loss_on_slots_tilelang=indexer_loss_on_slots,
                                                              slot_kl_tilelang=_reference_slot_kl),
    }
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)


def fake_loader(flashmla=None):
    modules = {"flashmla": {"flashmla": flashmla or fake_flashmla()}, "megatron": fake_megatron_modules(),
               "tilelang": fake_tilelang_modules(), "dsa_ref": {}}

    def load(family, peers_dir, device):
        return bp.Family(family, {"fake": True}, loader=lambda name: modules[family][name])
    return load


def run_all(shapes, loader, impls=bp.IMPLS):
    results = {"results": [], "shapes": [dict(bp.Inputs(s, bp.TINY, device=CPU).describe(), fingerprints={})
                                         for s in shapes], "families": {}}
    for family in bp.FAMILIES:
        state = bp.run_family(family, impls, shapes, peers_dir=Path("/nonexistent"), device=CPU, dims=bp.TINY,
                              repeat=1, loader=loader, log=lambda s: None)
        expected = [(i.op, s.name, i.name) for s in shapes for i in impls if i.family == family]
        bp._merge_family(results, state, expected, None)
    return bp.finish(results)


def by_key(results):
    return {(r["op"], r["shape"], r["impl"]): r for r in results["results"]}


# ------------------------------------------------------------------------------------------ inputs


def test_inputs_are_reproducible_part_by_part_and_plant_empty_rows():
    a, b = inputs(), inputs()
    _ = b.d_out, b.iq  # drawing other parts first changes nothing
    assert torch.equal(a.idx, b.idx) and torch.equal(a.q, b.q) and torch.equal(a.iq, b.iq)
    assert a.fingerprint()["idx"] == int(b.idx.sum())
    for r in a.empty_rows:
        assert (a.idx[r] == -1).all()
        assert any(lo <= r < hi for lo, hi in a.check_blocks), "every empty row lies in a check block"
    valid = a.idx >= 0
    assert (a.idx[valid] < a.ends[:, None].expand_as(a.idx)[valid]).all(), "causal: inside each window"
    assert (a.idx[a.sparse_rows] == -1).any()
    u = bp.Inputs(bp.Shape(16, 32, "uniform"), bp.TINY, device=CPU)
    assert (u.idx[~torch.isin(torch.arange(16), torch.tensor(u.empty_rows))] >= u.ends[0]).any(), \
        "uniform indices also reach keys after the queries' positions"


def test_peer_layouts():
    x = inputs()
    q, kv, idx = bp.thd_peer_inputs(x, "flashmla_sparse_prefill")
    assert kv.shape == (32, 1, 80) and idx.shape == (16, 1, 16) and idx.dtype == torch.int32
    assert torch.equal(idx[:, 0].long(), x.idx)
    q4, kv4, idx4 = bp.bshd_peer_inputs(x)
    assert q4.shape == (1, 16, 16, 80) and kv4.shape == (1, 33, 1, 80) and (kv4[0, 32] == 0).all()
    assert idx4.dtype == torch.int32 and ((idx4[0, :, 0] == 32) == (x.idx < 0)).all()


def test_timing_pauses_the_garbage_collector_and_restores_it():
    import gc

    seen = []
    assert gc.isenabled()
    result = bp.time_call(lambda: seen.append(gc.isenabled()), repeat=3, device=torch.device("cpu"), flush=None)
    assert seen == [False] * 4 and gc.isenabled(), "off for the warm-up and the timed calls, on again after"
    assert set(result) == {"ms_per_call", "ms_back_to_back"}
    with pytest.raises(RuntimeError), bp._gc_paused():
        raise RuntimeError("a failing call")
    assert gc.isenabled(), "back on after a failure too"


def test_parse_shapes():
    assert [s.name for s in bp.parse_shapes("4096x8192,4096x32768:uniform")] == \
        ["4096x8192 causal", "4096x32768 uniform"]
    for bad in ("4096", "4096x8192:random", "8192x4096"):
        with pytest.raises(ValueError):
            bp.parse_shapes(bad)


# ------------------------------------------------------------------------------------------ checks


@pytest.mark.parametrize("convention, q_start, out_fact, lse_fact", [
    ("dsa_ref", 0, "0", "-inf"),
    ("flashmla_sparse_prefill", 0, "0", "+inf"),
    ("megatron_tilelang_ops", 0, "0", "0"),
])
def test_forward_check_passes_a_faithful_thd_fake_and_names_its_empty_rows(convention, q_start, out_fact, lse_fact):
    x = inputs()
    q, kv, idx = (x.q, x.kv, x.idx) if convention == "dsa_ref" else bp.thd_peer_inputs(x, convention)
    out, lse = _fake_forward(convention)(q, kv, idx, x.sm_scale, x.dims.dim_v)
    rec = bp.check_sparse_forward(out, lse, q, kv, idx, x, convention=convention, q_start=q_start)
    assert rec["status"] == "ok", rec
    assert rec["facts"]["empty_rows"] == {"out": out_fact, "lse": lse_fact}
    assert rec["facts"]["slots_dropped"] == 0 and rec["facts"]["slots_added"] == 0


def test_forward_check_flags_a_flashmla_that_breaks_its_empty_row_convention():
    x = inputs()
    q, kv, idx = bp.thd_peer_inputs(x, "flashmla_sparse_prefill")
    out, lse = _fake_forward("dsa_ref")(q, kv, idx[:, 0].long(), x.sm_scale, x.dims.dim_v)  # -inf, not +inf
    rec = bp.check_sparse_forward(out, lse, q, kv, idx, x, convention="flashmla_sparse_prefill", q_start=0)
    assert rec["status"] == "mismatch"
    assert not rec["tensors"]["lse"]["ok"] and rec["tensors"]["out"]["ok"]
    assert rec["facts"]["empty_rows"]["lse"] == "-inf"


def test_forward_check_flags_a_base2_lse_read_as_natural():
    x = inputs()
    q, kv, idx = bp.thd_peer_inputs(x, "flashmla_sparse_prefill")
    out, lse = _fake_forward("megatron_tilelang_ops")(q, kv, idx, x.sm_scale, x.dims.dim_v)
    lse = torch.where(lse == 0, torch.full_like(lse, float("inf")), lse)  # right markers, wrong base
    rec = bp.check_sparse_forward(out, lse, q, kv, idx, x, convention="flashmla_sparse_prefill", q_start=0)
    assert rec["status"] == "mismatch" and rec["tensors"]["lse"]["max_abs"] > 0.1


def test_tilelang_checks_name_nan_rows_and_the_keys_the_simple_kernel_drops():
    x = inputs()
    q4, kv4, idx4 = bp.bshd_peer_inputs(x)
    kv = kv4[:, :32]
    out, lse = _fake_forward("tilelang_deepseek_v32", q_start=x.shape.q_start)(q4, kv, idx4, x.sm_scale, 64)
    rec = bp.check_sparse_forward(out, lse, q4, kv, idx4, x, convention="tilelang_deepseek_v32",
                                  q_start=x.shape.q_start)
    assert rec["status"] == "ok" and rec["facts"]["empty_rows"] == {"out": "NaN", "lse": "-inf"}
    assert rec["facts"]["slots_dropped"] == 0
    simple_out, simple_lse = _fake_forward("tilelang_deepseek_v32", q_start=0)(q4, kv, idx4, x.sm_scale, 64)
    rec = bp.check_sparse_forward(simple_out, simple_lse, q4, kv, idx4, x, convention="tilelang_deepseek_v32", q_start=0)
    assert rec["status"] == "ok", "the oracle predicts the simple kernel, position rule included"
    assert rec["facts"]["slots_dropped"] > 0 and "ignores the real q_start" in rec["facts"]["position_rule"]
    # checked as if it placed the queries right, the simple kernel's output is wrong
    rec = bp.check_sparse_forward(simple_out, simple_lse, q4, kv, idx4, x, convention="tilelang_deepseek_v32",
                                  q_start=x.shape.q_start)
    assert rec["status"] == "mismatch"


# ------------------------------------------------------------------------------------------ every adapter


def test_every_adapter_runs_and_passes_its_check_with_faithful_fakes(fake_dsa_ref_kernels):
    results = run_all([SHAPE, SQUARE, bp.Shape(16, 32, "uniform")], fake_loader())
    by = by_key(results)
    assert len(by) == 3 * len(bp.IMPLS)
    for key, rec in by.items():
        assert rec["status"] == "ok", (key, rec.get("reason"))
        assert rec["check"]["status"] == "ok", (key, rec["check"])
        assert rec["ms_per_call"] > 0 and "ratio_to_dsa_ref" in rec
    fwd = by[("sparse_fwd", SHAPE.name, "flashmla")]["check"]["facts"]
    assert fwd["empty_rows"] == {"out": "0", "lse": "+inf"}
    assert by[("sparse_fwd", SHAPE.name, "tilelang_simple")]["check"]["facts"]["slots_dropped"] > 0
    assert by[("sparse_fwd", SQUARE.name, "tilelang_simple")]["check"]["facts"]["slots_dropped"] == 0
    assert by[("sparse_bwd", SHAPE.name, "megatron")]["check"]["facts"]["empty_rows_dq"] == "0"
    assert by[("sparse_fwd", SHAPE.name, "tilelang_pipelined")]["note"].startswith("the compiled kernel")
    assert all(s["inputs_identical"] for s in results["shapes"])


def test_a_peer_that_raises_or_lies_is_recorded_and_the_run_goes_on(fake_dsa_ref_kernels):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed")

    loader = fake_loader(flashmla=SimpleNamespace(sparse_prefill_fwd=broken))
    results = run_all([SHAPE], loader, impls=[i for i in bp.IMPLS if i.op == "sparse_fwd"])
    by = by_key(results)
    rec = by[("sparse_fwd", SHAPE.name, "flashmla")]
    assert rec["status"] == "failed" and "RuntimeError: kernel launch failed" in rec["reason"]
    assert by[("sparse_fwd", SHAPE.name, "megatron")]["status"] == "ok"
    lying = run_all([SHAPE], fake_loader(flashmla=fake_flashmla(empty_lse=float("-inf"))),
                    impls=[i for i in bp.IMPLS if i.name == "flashmla"])
    assert by_key(lying)[("sparse_fwd", SHAPE.name, "flashmla")]["check"]["status"] == "mismatch"


def test_missing_peers_are_skipped_without_a_crash(tmp_path):
    for family in ("flashmla", "megatron", "tilelang"):
        with pytest.raises(bp.Unavailable, match="no "):
            bp.load_family(family, tmp_path / "none", CPU)
    out = tmp_path / "r.json"
    assert bp.main(["--in-process", "--tiny", "--device", "cpu", "--shapes", "16x32", "--peers",
                    str(tmp_path / "none"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["schema"] == bp.SCHEMA and len(results["results"]) == len(bp.IMPLS)
    assert all(r["status"] == "skipped" and r["reason"] for r in results["results"])
    assert results["families"]["flashmla"]["status"] == "skipped"
    page.render(results, source="r.json")  # a run with nothing measured still renders


def test_a_crashed_family_process_is_recorded_and_resumed(fake_dsa_ref_kernels, tmp_path):
    impls = [i for i in bp.IMPLS if i.op == "sparse_fwd"]
    state = {"family": "megatron", "status": "ok", "results": [], "fingerprints": {},
             "running": ["sparse_fwd", SHAPE.name, "megatron"]}
    assert bp.record_crash(state, -11, "Segmentation fault")
    assert state["results"][0]["status"] == "failed" and "exit code -11" in state["results"][0]["reason"]
    budget = {"family": "tilelang", "results": [], "running": ["sparse_fwd", SHAPE.name, "tilelang_simple"]}
    assert bp.record_crash(budget, -9, "tail")  # the benchmark's own kill at --budget-s says so
    (cut,) = budget["results"]
    assert cut["reason"] == "the tilelang process was stopped at the time budget while this ran: tail"
    assert not cut["crashed_process"]
    assert page.short_reason(cut["reason"]) == "the tilelang process was stopped at the time budget while this ran"
    path = tmp_path / "megatron.json"
    bp._write_json(path, state)
    state = bp.run_family("megatron", impls, [SHAPE, SQUARE], peers_dir=tmp_path, device=CPU, dims=bp.TINY,
                          repeat=1, state_path=path, loader=fake_loader(), log=lambda s: None)
    keys = [bp._key(r) for r in state["results"]]
    assert keys == [("sparse_fwd", SHAPE.name, "megatron"), ("sparse_fwd", SQUARE.name, "megatron")]
    assert state["results"][1]["status"] == "ok" and state["running"] is None
    results = {"results": [], "shapes": [{"name": SHAPE.name, "fingerprints": {}}], "families": {}}
    bp._merge_family(results, state, [("sparse_fwd", SHAPE.name, "megatron"), ("sparse_fwd", "99x99 causal", "megatron")],
                     "process ended")
    assert [r["status"] for r in results["results"]] == ["failed", "failed"]
    assert results["results"][1]["reason"] == "process ended"


# ------------------------------------------------------------------------------------------ the page


def synthetic_results() -> dict:
    """A small results file in the schema bench_peers writes, with one of each outcome."""
    def rec(op, impl, family, ms, check="ok", **extra):
        r = {"op": op, "shape": "4096x8192 causal", "impl": impl, "family": family, "status": "ok",
             "ms_per_call": ms, "ms_back_to_back": ms * 0.95, "tflops": 1000.0 / ms}
        r["check"] = check if isinstance(check, dict) else {"status": check, "tensors": {}, "notes": []}
        r.update(extra)
        return r

    mismatch = {"status": "mismatch", "max_abs": "inf", "rel_l2": 0.5, "notes": [],
                "tensors": {"out": {"ok": False, "rel_l2": 0.5, "max_abs": "inf", "nonfinite": 64,
                                    "nonfinite_mismatch": 64, "failures": ["64 positions disagree"]}},
                "facts": {"empty_rows": {"out": "NaN", "lse": "-inf"}, "slots_dropped": 1234,
                          "slots_valid_in_dsa_ref": 8000000, "slots_added": 0}}
    results = {
        "schema": bp.SCHEMA,
        "meta": {"date": "2099-01-01", "gpu": "Fake GPU", "torch": "x", "cuda": "y", "tilelang": "z",
                 "command": "python benchmarks/bench_peers.py", "timing": "per call and back to back"},
        "formulas": {op: o.formula for op, o in bp.OPS.items()},
        "impls": bp.impl_table(), "conventions": bp.convention_table(),
        "shapes": [{"name": "4096x8192 causal", "inputs_identical": True}],
        "results": [
            rec("sparse_fwd", "dsa_ref", "dsa_ref", 4.0, ratio_to_dsa_ref=1.0),
            rec("sparse_fwd", "flashmla", "flashmla", 3.2, ratio_to_dsa_ref=1.25,
                check={"status": "ok", "tensors": {}, "facts": {"empty_rows": {"out": "0", "lse": "+inf"},
                                                                 "slots_dropped": 0, "slots_added": 0}}),
            rec("sparse_fwd", "tilelang_simple", "tilelang", 8.0, ratio_to_dsa_ref=0.5, check=mismatch),
            {"op": "sparse_fwd", "shape": "4096x8192 causal", "impl": "megatron", "family": "megatron",
             "status": "failed", "reason": "AssertionError: q and kv must have the same embedding dimension"},
            {"op": "sparse_fwd", "shape": "4096x8192 causal", "impl": "tilelang_pipelined", "family": "tilelang",
             "status": "skipped", "reason": "tilelang: no .gpu/peers/tilelang_examples"},
            rec("kl_loss", "megatron", "megatron", 0.1, ratio_to_dsa_ref=11.0, tflops=None),
        ],
    }
    return results


def test_page_renders_the_conformance_and_speed_tables():
    text = page.render(synthetic_results(), source="benchmarks/results/fake.json")
    assert text.startswith("<!-- Generated by tools/known_kernels_page.py from benchmarks/results/fake.json")
    conformance = text.split("## Conformance")[1].split("## Speed")[0]
    assert "| sparse_fwd | flashmla | ok |" in conformance and "LSE +inf" in conformance
    assert "**mismatch** (out: max \\|err\\| inf, rel. L2 0.5, 64 non-finite" in conformance
    assert "1234 of 8000000" in conformance
    assert "failed: AssertionError: q and kv must have the same embedding dimension" in conformance
    assert "skipped: tilelang: no .gpu/peers/tilelang_examples" in conformance
    speed = text.split("## Speed")[1].split("## How to run it")[0]
    assert "2099-01-01, Fake GPU" in speed
    assert "| 4096x8192 causal | 4.000 / 3.800 (250) | 3.200 / 3.040 (312, x1.25) |" in speed
    assert "[8.000 / 7.600 (125, x0.50)]" in speed, "a mismatched result is bracketed"
    assert "0.100 / 0.095 (x11.00)" in speed and "no FLOP count" in speed
    with pytest.raises(ValueError, match="schema"):
        page.render({"schema": "something else"})


def test_an_op_measured_again_takes_all_its_rows_from_the_later_run():
    first = synthetic_results()
    later = copy.deepcopy(first)
    later["meta"].update(date="2099-02-02", command="bench_peers.py --ops kl_loss")
    later["results"] = [dict(r, ms_per_call=0.05, ratio_to_dsa_ref=2.0) for r in later["results"]
                        if r["op"] == "kl_loss"]
    merged = page.merge_runs([first, later], ["a.json", "b.json"])
    kl = [r for r in merged["results"] if r["op"] == "kl_loss"]
    assert len(kl) == 1 and kl[0]["ms_per_call"] == 0.05, "the later run's rows replace the op's rows"
    assert len(merged["results"]) == len(first["results"]), "the other ops keep the first run's rows"
    assert first["results"][-1]["ms_per_call"] == 0.1, "the inputs are not modified"
    text = page.render(merged, source="a.json and b.json")
    speed = text.split("## Speed")[1]
    assert "Measured in a run of its own: 2099-02-02" in speed and "(`b.json`)" in speed
    assert "0.050 / 0.095 (x2.00)" in speed


def test_a_family_the_later_run_left_out_keeps_its_rows_in_a_table_of_their_own():
    """A later run of sparse_fwd without TileLang's family: the main table and the findings hold only the
    later run; TileLang's rows stay, beside the earlier run's dsa_ref, with the earlier run's ratios."""
    first = synthetic_results()
    later = copy.deepcopy(first)
    later["meta"].update(date="2099-03-03", command="bench_peers.py --ops sparse_fwd --impls dsa_ref,flashmla")
    later["results"] = [dict(r, ms_per_call=r["ms_per_call"] / 2) for r in later["results"]
                        if r["op"] == "sparse_fwd" and r["family"] in ("dsa_ref", "flashmla")]
    merged = page.merge_runs([first, later], ["a.json", "b.json"])
    tl = [r for r in merged["results"] if r["family"] in ("tilelang", "megatron") and r["op"] == "sparse_fwd"]
    assert {r["impl"] for r in tl} == {"megatron", "tilelang_simple", "tilelang_pipelined"}
    assert all(r["earlier_run"]["source"] == "a.json" for r in tl)
    assert [r["ms_per_call"] for r in merged["earlier_dsa_ref"]] == [
        r["ms_per_call"] for r in first["results"] if r["op"] == "sparse_fwd" and r["family"] == "dsa_ref"]
    assert page._ok_recs(merged, "sparse_fwd", "tilelang_simple") == [], "kept rows never enter the findings"
    text = page.render(merged, source="a.json and b.json")
    assert "| sparse_fwd | tilelang_simple |" in text.split("## Conformance")[1], "their checks stay on the page"
    fwd = text.split("## Speed")[1].split("**sparse MLA forward")[1].split("**KL loss")[0]
    main, earlier = fwd.split("Not measured in that run")
    assert "| shape | dsa_ref | flashmla |" in main and "2.000 /" in main, "the later run's table: its own rows"
    assert "`a.json`" in earlier and "| shape | dsa_ref | megatron | tilelang_simple | tilelang_pipelined |" in earlier
    assert "| 4.000 / 3.800 (250) | failed | [8.000 / 7.600 (125, x0.50)] | skipped |" in earlier, \
        "the earlier dsa_ref and ratio beside the kept rows"
    merged_again = page.merge_runs([first, later, later], ["a.json", "b.json", "c.json"])
    assert merged_again["earlier_dsa_ref"] == merged["earlier_dsa_ref"], "a third run keeps the reference"


def test_page_without_results_states_conventions_and_how_to_measure():
    text = page.render(None)
    assert "Not measured yet" in text and "tools/gpu_session.sh peers" in text
    assert "| empty row: LSE | -inf | +inf | 0 | -inf |" in text
    assert "| empty row: output | 0 | 0 | 0 | NaN |" in text


def test_page_says_what_a_recheck_found_for_cells_the_older_check_failed():
    """A backward cell that an older check (no delta allowance) failed in dsa_ref and Megatron alike is
    explained on the page; a later run that re-checked the cell is named with what it found, pass or not."""
    def bwd(impl, family, status):
        t = {"ok": status == "ok", "rel_l2": 0.0027, "max_abs": 0.0597, "nonfinite": 0, "nonfinite_mismatch": 0,
             "failures": [] if status == "ok" else ["1 elements exceed atol + rtol * m"]}
        return {"op": "sparse_bwd", "shape": "4096x8192 causal", "impl": impl, "family": family, "status": "ok",
                "ms_per_call": 10.0, "ms_back_to_back": 9.5, "tflops": 200.0,
                "check": {"status": status, "notes": [], "tensors": {"dkv": t}}}

    results = copy.deepcopy(synthetic_results())
    results["results"] += [bwd("dsa_ref", "dsa_ref", "mismatch"), bwd("megatron", "megatron", "mismatch")]
    later = copy.deepcopy(synthetic_results())
    later["meta"]["date"] = "2099-01-02"
    later["results"] = [bwd("dsa_ref", "dsa_ref", "ok"), bwd("megatron", "megatron", "mismatch")]
    for r in later["results"]:
        r["check"]["notes"] = ["... plus the error a kernel's delta (from its rounded output) brings in"]
    text = page.findings_section(results)
    line = next(x for x in text if "outside the bound of the check these runs used" in x)
    assert "A later run" not in line
    results["rechecks"] = [{**later, "source": "later.json"}]
    line = next(x for x in page.findings_section(results) if "outside the bound of the check these runs used" in x)
    assert ("A later run checked them with the current oracle (2099-01-02, Fake GPU, `later.json`, `sparse_bwd` at "
            "4096x8192): dsa_ref passed; megatron failed.") in line


def test_committed_page_is_the_generators_output():
    committed = (ROOT / "docs" / "known_kernels.md").read_text()
    first = committed.splitlines()[0]
    assert first.startswith("<!-- Generated by tools/known_kernels_page.py"), "the page must be generated"
    results, source, figure = None, None, None
    if " from " in first:
        source = first.split(" from ")[1].split(";")[0]
        runs, _, rechecks = source.partition(" (re-checked by ")
        names = runs.split(" and ")
        results = page.merge_runs([json.loads((ROOT / n).read_text()) for n in names], names)
        if rechecks:
            results["rechecks"] = [{**json.loads((ROOT / n).read_text()), "source": n}
                                   for n in rechecks.removesuffix(")").split(" and ")]
        figure = page.FIGURE if page.FIGURE.is_file() else None
    assert committed == page.render(results, source=source, figure=figure), \
        "regenerate: python tools/known_kernels_page.py [RESULTS.json] > docs/known_kernels.md"


def test_plot_draws_the_synthetic_results(tmp_path):
    sys.path.insert(0, str(ROOT / "tools" / "plots"))
    import bench_peers_plot

    results = copy.deepcopy(synthetic_results())
    out = tmp_path / "peers.png"
    bench_peers_plot.plot(results, out)
    assert out.stat().st_size > 10_000


FAKE_CHILD = '''
import json, os, sys
state_path, family, mode, shapes, impls = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(";"), sys.argv[5].split(",")
todo = [(s, i) for s in shapes for i in impls]
if not os.path.exists(state_path):  # first process: one result, then it dies while running the second
    state = {"family": family, "status": "ok", "results": [], "fingerprints": {}, "running": None}
    state["results"].append({"op": "sparse_fwd", "shape": todo[0][0], "impl": todo[0][1], "family": family,
                             "status": "ok", "ms_per_call": 1.0, "ms_back_to_back": 1.0})
    print("about to fault", flush=True)
    if mode == "abort":  # killed by a signal while running the second
        state["running"] = ["sparse_fwd", todo[1][0], todo[1][1]]
        json.dump(state, open(state_path, "w"))
        os.abort()
    # a CUDA error bench_peers caught: recorded, then the process exits with its CUDA-error code
    state["results"].append({"op": "sparse_fwd", "shape": todo[1][0], "impl": todo[1][1], "family": family,
                             "status": "failed", "reason": "AcceleratorError: CUDA error: an illegal memory access",
                             "cuda_error": True})
    state["cuda_error"] = True
    json.dump(state, open(state_path, "w"))
    sys.exit(3)
state = json.load(open(state_path))
done = {(r["shape"], r["impl"]) for r in state["results"]}
for s, i in todo:
    if (s, i) not in done:
        state["results"].append({"op": "sparse_fwd", "shape": s, "impl": i, "family": family, "status": "ok",
                                 "ms_per_call": 2.0, "ms_back_to_back": 2.0})
state["running"] = None
json.dump(state, open(state_path, "w"))
'''


@pytest.mark.parametrize("mode", ["abort", "cuda_error"])
def test_orchestrator_resumes_a_family_whose_process_died(tmp_path, monkeypatch, mode):
    """Through real subprocesses: a family process that dies (SIGABRT, or the CUDA-error exit) is
    resumed in a fresh one; what it was running is recorded as failed, the rest is measured."""
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)

    def fake_command(args, family, state, *, ops, shapes, deadline, compile_only=False, impls=None):
        names = [i.name for i in bp.IMPLS if i.family == family and i.op == "sparse_fwd"]
        return [sys.executable, str(script), str(state), family, mode, ";".join(s.name for s in shapes),
                ",".join(names)]

    monkeypatch.setattr(bp, "_child_command", fake_command)
    out = tmp_path / "r.json"
    assert bp.main(["--device", "cpu", "--tiny", "--no-precompile", "--ops", "sparse_fwd", "--impls", "tilelang",
                    "--shapes", "16x32,16x16", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    by = {(r["shape"], r["impl"]): r for r in results["results"]}
    assert len(by) == 4
    first = by[("16x32 causal", "tilelang_simple")]
    assert first["status"] == "ok" and first["ms_per_call"] == 1.0, "kept from the process that died"
    crashed = by[("16x32 causal", "tilelang_pipelined")]
    assert crashed["status"] == "failed"
    if mode == "abort":
        assert crashed["crashed_process"] and "exit code -6" in crashed["reason"] and "about to fault" in crashed["reason"]
    else:
        assert "illegal memory access" in crashed["reason"]
    for impl in ("tilelang_simple", "tilelang_pipelined"):  # measured by the fresh process
        assert by[("16x16 causal", impl)]["ms_per_call"] == 2.0
