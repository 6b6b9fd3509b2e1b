"""TileLang kernel: top-k selection by radix select, with `dsa_ref.topk_indices`'s exact rule.

The readable `dsa_ref.topk_indices` sorts every row of scores completely (a stable descending
sort) and keeps the first ``topk`` entries. Sorting ``S`` keys to keep ``topk`` of them does far
more work than needed; this kernel only *selects*, in a handful of streaming passes over the row.

**Order-preserving keys.** Each fp32 score is turned into a ``uint32`` key whose unsigned order
is the order of the floats: for a positive float (sign bit 0) the sign bit is set, for a negative
float all bits are flipped. ``-0.0`` is first replaced by ``+0.0``, so the two zeros get the same
key, as they compare equal. ``-inf`` becomes ``0x007FFFFF``, the smallest key of any non-NaN float;
keys at or below it are never selectable. ``+inf`` is the largest key, a valid (highest) score.

**Radix select.** One block of threads owns one row. The key of the ``k``-th largest selectable
score (``k = topk``) is found one byte at a time, from the most significant byte down (4 passes):
each pass builds a 256-bin histogram of the byte, counting only the keys whose higher bytes equal
the prefix found so far. A suffix sum over the bins (a parallel scan: warp shuffles, then the
8 warp totals) finds the bin that holds the ``k``-th largest key; the keys in higher bins are
certainly selected, so ``k`` drops by their number and the bin extends the prefix. After the last
byte the prefix *is* the threshold key, and ``need`` (what is left of ``k``) says how many keys
equal to the threshold must be taken: the ones with the lowest key index, by the tie rule. The
histogram counts are warp-aggregated (the lanes of a warp holding the same byte elect one of them
to add their number), because real scores crowd into a few exponent bins on the first byte and
would otherwise serialise on one shared-memory counter.

If a row has at most ``topk`` selectable keys (short causal windows, ``topk >= S``), the first
pass already shows it and the row takes all of them: threshold ``-inf``'s key, ``need = 0``.

**Compaction.** A last pass walks the row in index order, ``threads`` keys at a time, and writes
the index of every key above the threshold, and of the first ``need`` keys equal to it. The
output slot of key ``i`` is ``(# keys above the threshold before i) + min(# equal keys before i,
need)``: two running counts, found with a block-wide prefix sum (warp ballots and popcounts, then
the per-warp totals through shared memory). So the output is **deterministic**: the selected keys
in ascending key-index order, then ``-1`` in the unused slots.

`topk_indices_tilelang` returns that set as it is (``sorted=False``) or, by default, in the
reference's order: a stable descending sort of the selected scores, which keeps equal scores in
ascending index order. The result is then identical to `dsa_ref.topk_indices`.

The row is read from global memory in every pass (it stays in L2 between passes); keys are
loaded ``VEC`` strided sub-chunks at a time so that several loads are in flight per thread.
"""

import functools

import torch

try:  # the wrappers and the CPU emulation below work without tilelang
    import tilelang
    import tilelang.language as T
except ImportError:  # pragma: no cover - exercised only on machines without tilelang
    tilelang = T = None

from ._target import compile_target

THREADS = 256  # threads per block (one block per row); 256 beat 512 and 1024 (benchmarks/tune_kernels.py)
VEC = 4  # strided sub-chunks of `threads` keys loaded together (loads in flight per thread)
RADIX_BITS = 8
RADIX = 1 << RADIX_BITS  # 256 bins per pass
PASSES = 32 // RADIX_BITS  # 4 passes of one byte each
SIGN = 0x80000000
NEG_INF_KEY = 0x007FFFFF  # the key of -inf: keys <= this are never selected
LOW16 = 0xFFFF

_PASS = {"tl.disable_thread_storage_sync": True}


# ----------------------------------------------------------------------------- the kernel


def _radix_key(x):
    """uint32 key of the fp32 ``x`` whose unsigned order is the float order (``-0.0`` = ``+0.0``).

    Built in the integer domain only, so fast-math float rules cannot fold the ``-0.0`` fix away.
    """
    bits = T.reinterpret(x, "uint32")
    bits = T.if_then_else(bits == T.uint32(SIGN), T.uint32(0), bits)  # -0.0 -> +0.0
    # negative floats: flip all bits (larger magnitude = smaller key); positive: set the sign bit
    return T.if_then_else(bits >= T.uint32(SIGN), T.bitwise_not(bits), bits | T.uint32(SIGN))


# --8<-- [start:topk_kernel]
@functools.lru_cache(maxsize=None)
def topk_kernel(threads: int = THREADS):
    """Compile the radix-select kernel; ``threads`` per block (a multiple of 32, 256 to 1024).

    Kernel arguments: ``Scores [T, S]`` fp32 (contiguous, no NaN), ``Out [T, topk]`` int64
    (written completely: the selected key indices in ascending order, then ``-1``). ``T``, ``S``
    and ``topk`` are runtime sizes, so one compilation serves every shape.
    """
    if tilelang is None:
        raise ImportError("the top-k kernel needs tilelang (pip install dsa_ref[gpu])")
    if threads % 32 or not RADIX <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [{RADIX}, 1024], got {threads}")
    num_q, num_kv, topk = T.dynamic("num_q"), T.dynamic("num_kv"), T.dynamic("topk")
    warps = threads // 32
    step = threads * VEC  # keys per loop step

    @T.prim_func
    def main(Scores: T.Tensor((num_q, num_kv), "float32"), Out: T.Tensor((num_q, topk), "int64")):
        with T.Kernel(num_q, threads=threads) as row:
            hist = T.alloc_shared((RADIX,), "int32", scope="shared")  # the byte histogram
            bin_sums = T.alloc_shared((RADIX // 32,), "int32", scope="shared")  # per-warp bin totals
            # found[0]: the bin holding the k-th largest key; found[1]: what is left of k after
            # the keys in higher bins; found[2]: 1 if the row has <= topk selectable keys
            found = T.alloc_shared((3,), "int32", scope="shared")
            # per-warp (above-threshold, equal) counts of one sub-chunk, packed as above + equal << 16;
            # two buffers, so the next sub-chunk can write while slow threads still read this one
            warp_counts = T.alloc_shared((2, warps), "int32", scope="shared")

            keys = T.alloc_local((VEC,), "uint32")
            prefix = T.alloc_var("uint32")  # the key bytes found so far ...
            prefix_mask = T.alloc_var("uint32")  # ... and which bits they cover
            remaining = T.alloc_var("int32")  # how many keys are still to be selected
            take_all = T.alloc_var("int32")
            digit = T.alloc_var("int32")
            peers = T.alloc_var("uint32")
            count = T.alloc_var("int32")
            suffix = T.alloc_var("int32")
            threshold = T.alloc_var("uint32")
            need = T.alloc_var("int32")
            above_run = T.alloc_var("int32")  # keys above the threshold in earlier sub-chunks
            equal_run = T.alloc_var("int32")  # keys equal to it in earlier sub-chunks
            before = T.alloc_var("int32")  # packed counts of the lower warps of this sub-chunk
            total = T.alloc_var("int32")  # packed counts of the whole sub-chunk
            above_bits = T.alloc_var("uint32")
            equal_bits = T.alloc_var("uint32")
            rank_above = T.alloc_var("int32")
            rank_equal = T.alloc_var("int32")

            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            lanes_below = (T.uint32(1) << T.cast(lane, "uint32")) - T.uint32(1)  # this lane's lower lanes

            if tx < RADIX:
                hist[tx] = 0
            prefix = T.uint32(0)
            prefix_mask = T.uint32(0)
            remaining = topk
            take_all = 0
            T.sync_threads()

            # ---- radix select: one byte of the threshold key per pass, most significant first
            for p in T.unroll(PASSES):
                shift = 32 - RADIX_BITS * (p + 1)
                if take_all == 0:  # block-uniform: every thread read the same flag
                    # histogram of this byte over the selectable keys that match the prefix
                    for c in T.serial(T.ceildiv(num_kv, step)):
                        for v in T.unroll(VEC):  # issue the VEC loads before using any
                            i = c * step + v * threads + tx
                            keys[v] = T.if_then_else(i < num_kv, _radix_key(Scores[row, i]), T.uint32(0))
                        for v in T.unroll(VEC):
                            # inactive lanes get the non-bin RADIX; every lane joins the match
                            digit = T.if_then_else(
                                keys[v] > T.uint32(NEG_INF_KEY) and (keys[v] & prefix_mask) == prefix,
                                T.cast((keys[v] >> T.uint32(shift)) & T.uint32(RADIX - 1), "int32"), RADIX)
                            peers = T.match_any_sync(digit)  # the lanes of this warp with the same byte
                            if digit < RADIX and (peers & lanes_below) == T.uint32(0):  # lowest such lane
                                T.atomic_add(hist[digit], T.cast(T.popcount(peers), "int32"))
                    T.sync_threads()

                    # suffix sums over the bins, part 1: inside each warp of 32 bins (shuffles)
                    if tx < RADIX:  # whole warps, so the shuffles see full warps
                        count = hist[tx]
                        hist[tx] = 0  # clear for the next pass (only this thread reads bin tx)
                        suffix = count
                        for s in T.unroll(5):
                            other = T.shfl_down(suffix, 1 << s)
                            suffix = suffix + T.if_then_else(lane + (1 << s) < 32, other, 0)
                        if lane == 0:
                            bin_sums[warp] = suffix  # this warp's 32 bins in total
                    T.sync_threads()

                    # part 2: add the bins of the higher warps; then suffix = # keys in bins >= tx
                    if tx < RADIX:
                        for w in T.unroll(RADIX // 32):
                            suffix = suffix + T.if_then_else(w > warp, bin_sums[w], 0)
                        if p == 0 and tx == 0:
                            found[2] = T.if_then_else(suffix <= remaining, 1, 0)  # all keys of the row
                        # the k-th largest is in the one bin with >= remaining keys at or above it
                        # and < remaining strictly above it
                        if suffix >= remaining and suffix - count < remaining:
                            found[0] = tx
                            found[1] = remaining - (suffix - count)
                    T.sync_threads()

                    if p == 0:
                        take_all = found[2]
                    if take_all == 0:
                        prefix = prefix | (T.cast(found[0], "uint32") << T.uint32(shift))
                        prefix_mask = prefix_mask | (T.uint32(RADIX - 1) << T.uint32(shift))
                        remaining = found[1]

            if take_all == 1:
                threshold = T.uint32(NEG_INF_KEY)  # every key above -inf; no -inf key
                need = 0
            else:
                threshold = prefix
                need = remaining

            # ---- compaction in index order: slot = above before + min(equal before, need)
            above_run = 0
            equal_run = 0
            for c in T.serial(T.ceildiv(num_kv, step)):
                for v in T.unroll(VEC):
                    i = c * step + v * threads + tx
                    keys[v] = T.if_then_else(i < num_kv, _radix_key(Scores[row, i]), T.uint32(0))
                for v in T.unroll(VEC):
                    i = c * step + v * threads + tx
                    above_bits = T.cast(T.ballot_sync(keys[v] > threshold), "uint32")
                    equal_bits = T.cast(T.ballot_sync(keys[v] == threshold), "uint32")
                    if lane == 0:
                        warp_counts[v % 2, warp] = (T.cast(T.popcount(above_bits), "int32")
                                                    + (T.cast(T.popcount(equal_bits), "int32") << 16))
                    T.sync_threads()
                    before = 0
                    total = 0
                    for w in T.unroll(warps):
                        total = total + warp_counts[v % 2, w]
                        before = before + T.if_then_else(w < warp, warp_counts[v % 2, w], 0)
                    # ranks among the keys of the row before key i (the fields never exceed 16 bits)
                    rank_above = (above_run + (before & LOW16)
                                  + T.cast(T.popcount(above_bits & lanes_below), "int32"))
                    rank_equal = (equal_run + (before >> 16)
                                  + T.cast(T.popcount(equal_bits & lanes_below), "int32"))
                    if keys[v] > threshold:
                        Out[row, rank_above + T.min(rank_equal, need)] = T.cast(i, "int64")
                    elif keys[v] == threshold and rank_equal < need:
                        Out[row, rank_above + rank_equal] = T.cast(i, "int64")
                    above_run = above_run + (total & LOW16)
                    equal_run = equal_run + (total >> 16)

            # ---- -1 in the slots past the selected keys
            for c in T.serial(T.ceildiv(topk, threads)):
                j = c * threads + tx
                if j < topk and j >= above_run + T.min(equal_run, need):
                    Out[row, j] = T.int64(-1)

    # every __syncthreads is written out above; the automatic pass would add a redundant one
    # per compaction sub-chunk (it cannot see that the two `warp_counts` buffers alternate)
    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:topk_kernel]


# ----------------------------------------------------------------------------- the wrapper


# --8<-- [start:topk_supported]
def _problem(scores, topk) -> tuple[type, str] | None:
    """``(exception type, message)`` for a call the kernel cannot take, else ``None``."""
    if not isinstance(scores, torch.Tensor):
        return TypeError, f"scores must be a torch.Tensor, got {type(scores).__name__}"
    if isinstance(topk, bool) or not isinstance(topk, int):
        return TypeError, f"topk must be an int, got {type(topk).__name__}"
    if topk < 1:
        return ValueError, f"topk must be >= 1, got {topk}"
    if topk >= 2**31:
        return ValueError, f"topk must be < 2**31, got {topk}"
    if not scores.is_cuda:
        return ValueError, f"scores must be on CUDA, got device {scores.device}"
    if scores.dtype != torch.float32:
        return TypeError, f"scores must be float32, got {scores.dtype}"
    if scores.dim() != 2:
        return ValueError, f"scores must have shape [T, S], got shape {tuple(scores.shape)} ({scores.dim()} dims)"
    if scores.shape[1] >= 2**31 or scores.shape[0] >= 2**31:
        return ValueError, f"scores is too large for int32 indexing: shape {tuple(scores.shape)}"
    return None


def topk_supported(scores, topk) -> str | None:
    """Why the top-k kernel cannot take this call, or ``None`` if it can.

    The kernel takes fp32 CUDA scores ``[T, S]`` (any strides: the wrapper makes them contiguous)
    and an int ``topk >= 1`` (it may exceed ``S``).
    """
    problem = _problem(scores, topk)
    return None if problem is None else problem[1]
# --8<-- [end:topk_supported]


# --8<-- [start:reference_order]
def _to_reference_order(scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Reorder a selected set to the reference order: highest score first, ties lower index first.

    Args:
        scores: float ``[T, S]``.
        selected: int64 ``[T, K]``, each row's selected keys in ascending index order, ``-1`` at the end.

    Returns:
        int64 ``[T, K]``. A stable sort keeps equal scores in their (ascending) index order, which
        is the tie rule; the ``-1`` slots get ``-inf`` and stay at the end, as no selected score
        is ``-inf``. ``-0.0`` becomes ``+0.0`` first, so the two zeros compare equal in any sort.
    """
    valid = selected >= 0
    values = scores.gather(1, selected.clamp_min(0))  # [T, K]
    values = torch.where(valid, values, torch.full_like(values, float("-inf")))
    values = torch.where(values == 0, torch.zeros_like(values), values)  # -0.0 -> +0.0
    order = torch.sort(values, dim=1, descending=True, stable=True).indices  # [T, K]
    return selected.gather(1, order)
# --8<-- [end:reference_order]


# --8<-- [start:topk_indices_tilelang]
def topk_indices_tilelang(scores: torch.Tensor, topk: int, *, sorted: bool = True,
                          check_nan: bool = True) -> torch.Tensor:
    """`dsa_ref.topk_indices` on the TileLang radix-select kernel.

    Args:
        scores: fp32 CUDA ``[T, S]`` index scores; ``-inf`` = not selectable.
        topk: slots per row (>= 1); may exceed ``S``.
        sorted: ``True`` (default): the reference's order, highest score first and equal scores
            lower index first, identical to `dsa_ref.topk_indices`. ``False``: the kernel's output
            as it is, the same set of keys in ascending index order (cheaper: no sort).
        check_nan: raise ``ValueError`` on NaN scores, like the reference (one extra read of the
            scores and a host synchronisation). With ``False`` the caller promises there is no NaN;
            NaN rows then get an unspecified (but valid-index) result.

    Returns:
        int64 ``[T, topk]``: per row the ``min(topk, #selectable)`` selected key indices, then
        ``-1`` in the remaining slots.
    """
    problem = _problem(scores, topk)
    if problem is not None:
        error, message = problem
        raise error(f"topk_indices_tilelang: {message}")
    scores = scores.detach().contiguous()
    if check_nan and bool(torch.isnan(scores).any()):
        raise ValueError("topk_indices_tilelang: scores contain NaN; mark unselectable keys with -inf instead")
    num_q, num_kv = scores.shape
    out = torch.empty((num_q, topk), dtype=torch.int64, device=scores.device)  # [T, topk]
    if num_q == 0:
        return out
    if num_kv == 0:
        return out.fill_(-1)
    topk_kernel()(scores, out)  # writes every slot
    return _to_reference_order(scores, out) if sorted else out
# --8<-- [end:topk_indices_tilelang]


# ----------------------------------------------------------------------------- CPU emulation


def _radix_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, S]`` holding the kernel's uint32 keys of fp32 ``scores`` (same bit tricks)."""
    bits = scores.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(bits == SIGN, torch.zeros_like(bits), bits)  # -0.0 -> +0.0
    return torch.where(bits >= SIGN, bits ^ 0xFFFFFFFF, bits | SIGN)


# --8<-- [start:radix_select_reference]
def _radix_select_reference(scores: torch.Tensor, topk: int, *, threads: int = THREADS) -> torch.Tensor:
    """The kernel's exact algorithm in PyTorch, on the CPU, for testing; ``sorted=False`` output.

    The same passes as the kernel, vectorised over rows: the byte histograms of the prefix-matching
    selectable keys, the suffix sums that pick a bin, and the compaction with its packed per-warp
    counts over sub-chunks of ``threads`` keys, warps of 32 lanes and in-warp ranks. It checks the
    invariants the kernel relies on (exactly one bin wins each pass, every slot is written once,
    the 16-bit count fields do not overflow) with ``assert``.

    Args:
        scores: float ``[T, S]`` (cast to fp32 like the kernel's input), no NaN.
        topk: slots per row (>= 1).

    Returns:
        int64 ``[T, topk]``: the selected keys in ascending index order, then ``-1``.
    """
    keys = _radix_keys(scores.detach().cpu())  # [T, S]
    num_q, num_kv = keys.shape
    selectable = keys > NEG_INF_KEY  # [T, S]
    prefix = torch.zeros(num_q, dtype=torch.int64)
    prefix_mask = torch.zeros(num_q, dtype=torch.int64)
    remaining = torch.full((num_q,), topk, dtype=torch.int64)
    take_all = torch.zeros(num_q, dtype=torch.bool)
    for p in range(PASSES):
        shift = 32 - RADIX_BITS * (p + 1)
        active = selectable & ((keys & prefix_mask[:, None]) == prefix[:, None])  # [T, S]
        digit = (keys >> shift) & (RADIX - 1)  # [T, S]
        hist = torch.zeros(num_q, RADIX, dtype=torch.int64).scatter_add_(1, digit, active.long())  # [T, 256]
        suffix = hist.flip(1).cumsum(1).flip(1)  # [T, 256]: keys in bins >= b
        if p == 0:
            take_all = suffix[:, 0] <= remaining  # the whole row fits
        above = suffix - hist  # keys in bins > b
        winner = (suffix >= remaining[:, None]) & (above < remaining[:, None])  # [T, 256]
        assert bool((winner.sum(1)[~take_all] == 1).all()), "exactly one bin must hold the k-th key"
        b = winner.long().argmax(1)  # [T]
        go = ~take_all
        prefix = torch.where(go, prefix | (b << shift), prefix)
        prefix_mask = torch.where(go, prefix_mask | ((RADIX - 1) << shift), prefix_mask)
        remaining = torch.where(go, remaining - above.gather(1, b[:, None])[:, 0], remaining)
    threshold = torch.where(take_all, torch.full_like(prefix, NEG_INF_KEY), prefix)  # [T]
    need = torch.where(take_all, torch.zeros_like(remaining), remaining)  # [T]

    # compaction: sub-chunks of `threads` keys (index = sub * threads + warp * 32 + lane)
    warps = threads // 32
    n_sub = -(-num_kv // (threads * VEC)) * VEC  # the kernel's loop: whole steps of VEC sub-chunks
    padded = torch.zeros(num_q, n_sub * threads, dtype=torch.int64)  # out-of-range keys are 0
    padded[:, :num_kv] = keys
    padded = padded.view(num_q, n_sub, warps, 32)
    is_above = padded > threshold[:, None, None, None]  # [T, sub, warp, lane]
    is_equal = padded == threshold[:, None, None, None]
    packed = is_above.sum(-1) + (is_equal.sum(-1) << 16)  # [T, sub, warp]: the ballot popcounts
    before = packed.cumsum(-1) - packed  # lower warps of the same sub-chunk
    total = packed.sum(-1)  # [T, sub]
    assert int((total & LOW16).max()) <= threads and int((total >> 16).max()) <= threads
    above_run = (total & LOW16).cumsum(1) - (total & LOW16)  # [T, sub]: earlier sub-chunks
    equal_run = (total >> 16).cumsum(1) - (total >> 16)
    lane_above = is_above.long().cumsum(-1) - is_above.long()  # popc(ballot & lanes below)
    lane_equal = is_equal.long().cumsum(-1) - is_equal.long()
    rank_above = above_run[:, :, None, None] + (before & LOW16)[..., None] + lane_above
    rank_equal = equal_run[:, :, None, None] + (before >> 16)[..., None] + lane_equal
    need4 = need[:, None, None, None]
    slot = torch.where(is_above, rank_above + torch.minimum(rank_equal, need4), rank_above + rank_equal)
    chosen = is_above | (is_equal & (rank_equal < need4))

    out = torch.full((num_q, topk), -2, dtype=torch.int64)  # -2: not written yet
    index = torch.arange(n_sub * threads).view(1, n_sub, warps, 32).expand_as(padded)
    rows = torch.arange(num_q).view(num_q, 1, 1, 1).expand_as(padded)
    assert bool((slot[chosen] < topk).all()), "a selected key's slot is out of range"
    out[rows[chosen], slot[chosen]] = index[chosen]
    assert int((out != -2).sum()) == int(chosen.sum()), "two selected keys share a slot"
    taken = (total & LOW16).sum(1) + torch.minimum((total >> 16).sum(1), need)  # [T]
    pad = torch.arange(topk)[None, :] >= taken[:, None]  # [T, topk]
    assert bool((out[pad] == -2).all()), "a slot past the selected keys was written"
    out[pad] = -1
    assert bool((out != -2).all()), "a slot was never written"
    return out
# --8<-- [end:radix_select_reference]
