r"""TileLang kernel: lightning-indexer scores, persistent and warp-specialised (bf16 or fp8 operands).

The same scores as `indexer_fwd_ws.indexer_ws_kernel`, with DeepGEMM's scheme for its fp8 MQA
logits (``sm90_fp8_mqa_logits``): one block per SM stays resident and walks the query pairs
``bx, bx + G, ...`` (last queries first), so a block's start-up (the query tile, its weights and
windows) never leaves the SM idle, and up to four consumer warpgroups share it:

* **consumers** (``consumers`` warpgroups, 2-4): consumer ``c`` takes keys ``64 c ... 64 c + 63``
  of every stage, runs one tensor-core GEMM ``logits [64 keys, 2 H_I] = K_sub @ [q[t]; q[t+1]]^T``,
  releases the stage, and then does the ReLU, the head weights (in registers), the sum over heads
  and the key scale (fp8) and **writes its scores itself** (``-inf`` outside each query's window):
  each thread sums its part of two keys' rows, and the four threads of a quad reduce-scatter those
  sums so that each ends with one (query, key) score to store; no score passes through shared memory.
* **the loader** (the first warp of the last warpgroup): keeps ``stages`` key tiles of
  ``64 consumers`` keys in flight. For each tile one elected thread issues the bulk-tensor copy of
  the keys and, in fp8, that of their scales (a one-dimensional tensor map, which needs the scales
  16-byte aligned; past the last key both come in as zeros), and arrives on the stage's barrier
  with the bytes of both. It reads each pair's windows itself, a pair ahead.
* **the preparers** (the other three warps, ``PREPARERS`` threads): while the consumers work on one
  pair, prepare the next in the free one of two query buffers (its ``[2 H_I, D_I]`` queries by
  ``cp.async``, the weights times the query scales, the windows and the pair's key-tile range),
  then write the ``-inf`` of the keys neither query of the current pair can see.

The last warpgroup gives up registers to the consumers (``setmaxnreg`` acts on a whole warpgroup:
the loader and the preparers keep 56 each): two or three consumers keep their ``64`` fp32
accumulators and ``32`` head weights in registers; four (104 registers each) read the weights
from shared memory instead. With ``pingpong`` two consumers (224 registers) keep two accumulators
each and start the next tile's GEMM before the epilogue of this one, so each overlaps its own
tensor-core work with its CUDA-core work. The key tile counter runs on across query pairs, so the
pipeline never drains between them. Barriers: ``q_ready`` / ``q_free`` per query buffer (the
preparers' copies and writes; the consumers' release), ``k_ready`` / ``k_free`` per key stage (the
loader's one arrival with the stage's bytes; the consumers' release).
"""

import functools

import tilelang
import tilelang.language as T

from ._target import compile_target
from .indexer_fwd_ws import check_indexer_sizes, score_prim_func

_PASS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}  # the roles and bulk copies are written out here

BLOCK_Q = 2  # queries per pair: the GEMM's N = 2 H_I
SUB = 64  # keys per consumer per stage: one warpgroup MMA's M
NUM_SMS = 132  # resident blocks (H100 SXM and H200: 132 SMs); a grid larger than the SMs still runs
LAST_WARPGROUP_REGS = 56  # registers a thread of the last warpgroup (loader, preparers) keeps; the consumers share the rest
PREPARERS = 96  # threads of the preparers: the last warpgroup less its first warp, the loader


def wgmma_layout(heads: int):
    """The register layout of a ``[64, 2 H_I]`` fp32 warpgroup-MMA accumulator (PTX ISA, "wgmma
    register fragments"): element ``(n, j)`` lives in thread ``32 (n // 16) + 4 (n % 8) + (j % 8) // 2``
    of the warpgroup, register ``4 (j // 8) + 2 ((n % 16) // 8) + j % 2``."""
    return T.Fragment((SUB, BLOCK_Q * heads), forward_thread_fn=lambda n, j: n // 16 * 32 + n % 8 * 4 + j % 8 // 2,
                      forward_index_fn=lambda n, j: j // 8 * 4 + n % 16 // 8 * 2 + j % 2)


def consumer_thread(c: int):
    """The thread's index ``x`` within consumer warpgroup ``c`` (0-127)."""
    return T.get_thread_binding() - 128 * c


def stored_key(x):
    """The key row (of the consumer's 64) whose score thread ``x`` stores after the quad's
    reduce-scatter (see ``epilogue``): ``16 (x // 32) + l // 4 + 8 r`` for lane ``l``, ``r = l % 2``."""
    return 16 * (x // 32) + (x % 32) // 4 + 8 * (x % 2)


def consumer_regs(consumers: int) -> int:
    """Registers a consumer thread asks for (``setmaxnreg``): what the block holds from its launch
    (``65536 / threads`` each, in steps of 8), less the last warpgroup's, shared among the consumers, in
    steps of 8: 224, 152, 104 for two, three, four consumers. Asking for more than the block holds
    would hang it (``setmaxnreg.inc`` waits for registers nobody frees)."""
    threads = 128 * (consumers + 1)
    launch = 65536 // threads // 8 * 8  # 168, 128, 96
    return (launch * threads - 128 * LAST_WARPGROUP_REGS) // (128 * consumers) // 8 * 8


# --8<-- [start:indexer_persistent_kernel]
@functools.lru_cache(maxsize=None)
def indexer_persistent_kernel(heads: int, dim: int, relu: bool = True, *, fp8: bool = False, consumers: int = 4,
                              stages: int = 2, pingpong: bool = False, grid: int = NUM_SMS):
    """Compile the persistent indexer-score kernel for ``H_I = heads`` (16, 32, 64), ``D_I = dim``.

    The arguments of `indexer_fwd.indexer_kernel` (``fp8=False``) or of
    `indexer_fwd_fp8.indexer_fp8_kernel` (``fp8=True``); ``Scores [T, S]`` fp32 is written in place,
    every entry. ``consumers`` (2-4) consumer warpgroups, ``stages`` (2-4) key tiles of
    ``64 consumers`` keys in flight (the shared memory must hold them: bf16 with four consumers
    takes two), ``pingpong`` (two consumers only): each consumer keeps two accumulators and starts
    the next tile's GEMM before the epilogue of this one; ``grid`` resident blocks (at most one per
    query pair).
    """
    check_indexer_sizes(heads, dim, fp8)
    if consumers not in (2, 3, 4) or stages not in (2, 3, 4):
        raise ValueError(f"consumers must be 2, 3 or 4 and stages 2, 3 or 4, got {consumers} and {stages}")
    if pingpong and consumers != 2:
        raise ValueError(f"pingpong keeps two accumulators and needs two consumers (224 registers), got {consumers}")
    block_n = SUB * consumers  # keys per stage
    w_smem = consumers == 4  # four consumers read the weights from shared memory: 32 registers fewer
    elem = 1 if fp8 else 2  # bytes per operand element
    smem = (2 * BLOCK_Q * heads + stages * block_n) * dim * elem
    if smem > 216 * 1024:
        raise ValueError(f"{stages} stages of {block_n} keys and two query buffers need {smem} bytes of shared "
                         "memory, more than the 216 KiB this kernel allows itself: use fewer stages or consumers")
    num_q, num_kv = T.dynamic("num_q"), T.dynamic("num_kv")
    dtype = "float8_e4m3fn" if fp8 else "bfloat16"
    f32 = "float32"
    chunk = 16 // elem  # elements per 16-byte cp.async
    q_chunks = (BLOCK_Q * heads * dim // chunk + PREPARERS - 1) // PREPARERS  # cp.async per preparer per query pair

    def pair_t0(bx, j, nqb, G):
        """First query of the ``j``-th pair of block ``bx``: pairs ``bx, bx + G, ...``, counted from the end."""
        return (nqb - 1 - (bx + j * G)) * BLOCK_Q

    def pair_queries(t0):
        """The two queries whose windows a pair at ``t0`` takes: a pair past the last query repeats it."""
        return T.min(t0, num_q - 1), T.min(t0 + 1, num_q - 1)

    def tile_range(start_a, end_a, start_b, end_b):
        """``(first tile, tiles)``: the key tiles either of a pair's windows reaches."""
        lo = T.min(T.min(start_a, start_b), num_kv)  # the keys either query can see
        hi = T.max(T.max(end_a, end_b), 0)
        return lo // block_n, T.max(T.ceildiv(hi, block_n), lo // block_n) - lo // block_n

    @T.macro
    def prepare(q, t0, qb, Q, QS, W, Starts, Ends, q_s, w_s, meta_s, q_ready, q_free, parity, nxt_first, nxt_tiles):
        """Preparer thread ``q`` (of ``PREPARERS``): the pair at ``t0`` into query buffer ``qb``
        (``q_free`` waited with ``parity``); ``meta_s[qb] = (start_0, end_0, start_1, end_1, first
        tile, tiles)``, and the first tile and tile count in ``nxt_first``, ``nxt_tiles``. A pair
        past the last query repeats it: its columns are computed and never stored."""
        t_a, t_b = pair_queries(t0)
        nxt_first[0], nxt_tiles[0] = tile_range(Starts[t_a], Ends[t_a], Starts[t_b], Ends[t_b])
        T.barrier_wait(q_free[qb], parity)
        for u in T.unroll(q_chunks, annotations={"pragma_unroll_factor": 1}):  # (unrolled, 56 registers spill)
            i = u * PREPARERS + q  # chunk i of the buffer
            if i < BLOCK_Q * heads * dim // chunk:
                r = i // (dim // chunk)  # row qi * H_I + h of the buffer
                col = (i % (dim // chunk)) * chunk
                T.ptx_cp_async(T.access_ptr(q_s[qb, r, col], "w", chunk),
                               T.access_ptr(Q[T.min(t0 + r // heads, num_q - 1), r % heads, col], "r", chunk),
                               chunk)
        T.cp_async_barrier_noinc(q_ready[qb])  # arrives once this thread's copies have landed
        for u in T.unroll((BLOCK_Q * heads + PREPARERS - 1) // PREPARERS):  # the weights (times the query scales)
            i = u * PREPARERS + q
            if i < BLOCK_Q * heads:
                t = T.min(t0 + i // heads, num_q - 1)
                if fp8:
                    w_s[qb, i // heads, i % heads] = T.if_then_else(t0 + i // heads < num_q,
                                                                   W[t, i % heads] * QS[t, i % heads], 0)
                else:
                    w_s[qb, i // heads, i % heads] = T.if_then_else(t0 + i // heads < num_q, W[t, i % heads], 0)
        if q == 0:
            meta_s[qb, 0] = Starts[t_a]
            meta_s[qb, 1] = Ends[t_a]
            meta_s[qb, 2] = Starts[t_b]
            meta_s[qb, 3] = Ends[t_b]
            meta_s[qb, 4] = nxt_first[0]
            meta_s[qb, 5] = nxt_tiles[0]
        T.barrier_arrive(q_ready[qb])  # (a plain arrive releases the weights and windows written above)

    @T.macro
    def fill_outside(q, t0, first, tiles, Scores):
        """Preparer thread ``q``: ``-inf`` in both rows of the pair at ``t0`` for the keys before its
        first tile and from the end of its last one (the tiles no query of the pair can see)."""
        left = T.min(first[0] * block_n, num_kv)  # keys 0 ... left - 1
        right = T.min((first[0] + tiles[0]) * block_n, num_kv)  # keys right ... num_kv - 1
        for u in T.serial(T.ceildiv(left, PREPARERS)):
            if u * PREPARERS + q < left:
                for qi in T.unroll(BLOCK_Q):
                    if t0 + qi < num_q:
                        Scores[t0 + qi, u * PREPARERS + q] = -T.infinity(f32)
        for u in T.serial(T.ceildiv(num_kv - right, PREPARERS)):
            if right + u * PREPARERS + q < num_kv:
                for qi in T.unroll(BLOCK_Q):
                    if t0 + qi < num_q:
                        Scores[t0 + qi, right + u * PREPARERS + q] = -T.infinity(f32)

    @T.macro
    def prepare_all(q, bx, nqb, G, n_pairs, Q, QS, W, Starts, Ends, Scores, q_s, w_s, meta_s, q_ready, q_free,
                    first, tiles, nxt_first, nxt_tiles):
        """The preparers (thread ``q`` of ``PREPARERS``) over the block's pairs: pair ``j + 1`` into
        its buffer once the consumers are done with pair ``j - 1``, then the ``-inf`` of pair ``j``."""
        args_q = (Q, QS, W, Starts, Ends, q_s, w_s, meta_s, q_ready, q_free)
        prepare(q, pair_t0(bx, 0, nqb, G), 0, *args_q, 1, nxt_first, nxt_tiles)
        for j in T.serial(n_pairs):
            first[0] = nxt_first[0]
            tiles[0] = nxt_tiles[0]
            if j + 1 < n_pairs:
                prepare(q, pair_t0(bx, j + 1, nqb, G), 1 - j % 2, *args_q, (((j + 1) // 2) & 1) ^ 1,
                        nxt_first, nxt_tiles)
            fill_outside(q, pair_t0(bx, j, nqb, G), first, tiles, Scores)
        T.ptx_commit_group()  # (the last pair's queries land before the thread exits)
        T.ptx_wait_group(0)

    @T.macro
    def fetch_windows(t0, Starts, Ends, win_n):
        """The loader: the windows of the pair at ``t0`` into ``win_n`` (used a pair later)."""
        t_a, t_b = pair_queries(t0)
        win_n[0] = Starts[t_a]
        win_n[1] = Ends[t_a]
        win_n[2] = Starts[t_b]
        win_n[3] = Ends[t_b]

    @T.macro
    def load_tile(it, s0, K, KS, k_s, ks_s, k_ready, k_free):
        """The loader warp: key tile ``it`` (keys ``s0 ...``) into stage ``it % stages`` once it is
        free. One elected thread (the same lane for both copies: ``elect.sync`` picks it
        deterministically) adds each copy's bytes to the stage's barrier and issues it, and arrives
        after the last one, so the stage completes when both have landed."""
        stage = it[0] % stages
        T.barrier_wait(k_free[stage], ((it[0] // stages) & 1) ^ 1)
        T.tma_copy(K[s0:s0 + block_n, :], k_s[stage, :, :], barrier=k_ready[stage],  # rows past S: zeros
                   leader_scope_threads=32, annotations={"emit_arrive": T.int32(0 if fp8 else 1)})
        if fp8:  # the tile's key scales (past S: zeros)
            T.tma_copy(KS[s0:s0 + block_n], ks_s[stage, :], barrier=k_ready[stage], leader_scope_threads=32,
                       annotations={"emit_arrive": T.int32(1)})

    @T.macro
    def load_all(bx, nqb, G, n_pairs, K, KS, Starts, Ends, k_s, ks_s, k_ready, k_free, it, first, tiles, win_n):
        """The loader warp over the block's pairs: every key tile of each, the tile counter running on."""
        fetch_windows(pair_t0(bx, 0, nqb, G), Starts, Ends, win_n)
        it[0] = 0
        for j in T.serial(n_pairs):
            first[0], tiles[0] = tile_range(win_n[0], win_n[1], win_n[2], win_n[3])
            if j + 1 < n_pairs:  # the next pair's windows, read while this pair's tiles go out
                fetch_windows(pair_t0(bx, j + 1, nqb, G), Starts, Ends, win_n)
            for kt in T.serial(tiles[0]):
                load_tile(it, (first[0] + kt) * block_n, K, KS, k_s, ks_s, k_ready, k_free)
                it[0] = it[0] + 1

    @T.macro
    def issue(c, it_n, qb, k_s, q_s, logits, k_ready, asynchronous):
        """Consumer ``c``: wait for key tile ``it_n`` (the running tile counter), then start
        ``logits [64 keys, 2 H_I] = K_sub @ [q[t0]; q[t0 + 1]]^T`` (``asynchronous``: without waiting)."""
        stage = it_n % stages
        T.barrier_wait(k_ready[stage], (it_n // stages) & 1)
        if asynchronous:
            T.wgmma_gemm(k_s[stage, c * SUB:(c + 1) * SUB, :], q_s[qb, :, :], logits, transpose_B=True,
                         clear_accum=True)
        else:
            T.gemm(k_s[stage, c * SUB:(c + 1) * SUB, :], q_s[qb, :, :], logits, transpose_B=True,
                   clear_accum=True)

    @T.macro
    def release(c, it_n, ks_s, ks_f, k_free):
        """Consumer ``c``: the GEMM of key tile ``it_n`` has read it; keep its key scales (fp8), hand it back."""
        if fp8:  # the scale of the one key this thread stores (see `epilogue`)
            ks_f[0] = ks_s[it_n % stages, c * SUB + stored_key(consumer_thread(c))]
        T.barrier_arrive(k_free[it_n % stages])

    @T.macro
    def epilogue(c, kt, qb, t0, Scores, w_s, logits, part, row, ks_f, w_f, win, first):
        """``Scores[t0 + qi, s0 + n] = ks[n] * sum_h w[qi, h] relu(logits[n, qi H_I + h])`` for the
        consumer's 64 keys ``s0 ...`` of the pair's tile ``kt``, ``-inf`` outside each query's window.

        Written per thread on the accumulator's warpgroup-MMA layout (`wgmma_layout`): thread ``x``
        (lane ``l``) holds keys ``n_r = 16 (x // 32) + l // 4 + 8 r`` (``r`` = 0, 1) and, of each query,
        the heads ``8 g + 2 (l % 4) + e`` (``g < H_I / 8``, ``e`` = 0, 1). It sums its 2 x 2
        (query, key) partial sums over its heads, each in two accumulators ``part[v + 4 e]`` (two
        chains of ``H_I / 8`` fused multiply-adds, not one twice as long that waits on itself)
        joined at the end, then the four threads of a quad reduce-scatter
        them (two shuffle rounds) so that thread ``l % 4 = 2 b + r`` ends with the full sum of query
        ``b``, key ``n_r``, and stores that one score."""
        s0 = (first[0] + kt) * block_n + c * SUB
        x = consumer_thread(c)
        lane = x % 32
        b = (lane // 2) % 2  # the query this thread stores
        r = lane % 2  # and its key row
        for v in T.unroll(2 * BLOCK_Q):  # v = 2 qi + r': this thread's part of query qi, key n_r'
            part[v] = 0.0
            part[v + 4] = 0.0
            for g in T.unroll(heads // 8):
                for e in T.unroll(2):
                    h = 8 * g + 2 * (lane % 4) + e
                    s = logits[16 * (x // 32) + lane // 4 + 8 * (v % 2), (v // 2) * heads + h]
                    w = w_s[qb, v // 2, h] if w_smem else w_f[(v // 2) * (heads // 4) + 2 * g + e]
                    part[v + 4 * e] = part[v + 4 * e] + (T.max(s, 0.0) if relu else s) * w
            part[v] = part[v] + part[v + 4]
        # reduce-scatter over the quad: lanes ^ 2 swap the other query's two keys, lanes ^ 1 the other key
        row[0] = T.if_then_else(b == 1, part[2], part[0]) + T.shfl_xor(T.if_then_else(b == 1, part[0], part[2]), 2)
        row[1] = T.if_then_else(b == 1, part[3], part[1]) + T.shfl_xor(T.if_then_else(b == 1, part[1], part[3]), 2)
        total = T.if_then_else(r == 1, row[1], row[0]) + T.shfl_xor(T.if_then_else(r == 1, row[0], row[1]), 1)
        key = s0 + stored_key(x)
        inside = key >= T.if_then_else(b == 1, win[2], win[0]) and key < T.if_then_else(b == 1, win[3], win[1])
        if t0 + b < num_q and key < num_kv:
            score = total * ks_f[0] if fp8 else total
            Scores[t0 + b, key] = T.if_then_else(inside, score, -T.infinity(f32))

    @T.macro
    def consume(c, bx, nqb, G, n_pairs, Scores, q_s, w_s, meta_s, k_s, ks_s, logits, logits_b, part, row, ks_f,
                w_f, win, q_ready, q_free, k_ready, k_free, it, first, tiles):
        """Consumer ``c`` (a Python int): keys ``64 c ...`` of every stage of every pair of the block."""
        it[0] = 0
        for j in T.serial(n_pairs):
            qb = j % 2
            t0 = pair_t0(bx, j, nqb, G)
            T.barrier_wait(q_ready[qb], (j // 2) & 1)
            for i in T.unroll(2 * BLOCK_Q):
                win[i] = meta_s[qb, i]  # start and end of query t0 + i // 2
            first[0] = meta_s[qb, 4]
            tiles[0] = meta_s[qb, 5]
            if not w_smem:  # this thread's heads (see `epilogue`) of both queries' weights
                for qi in T.unroll(BLOCK_Q):
                    for g in T.unroll(heads // 8):
                        for e in T.unroll(2):
                            h = 8 * g + 2 * (consumer_thread(c) % 4) + e
                            w_f[qi * (heads // 4) + 2 * g + e] = w_s[qb, qi, h]
            args = (qb, t0, Scores, w_s)
            if pingpong:
                # tiles take turns in two accumulators: one's GEMM runs while the other's epilogue
                # does; wait_wgmma(1) = "all but the newest GEMM are done". Every branch keeps one
                # rule: on entry to the loop body the tile `it` is in flight in `logits`.
                if tiles[0] > 0:  # (one branch, so that every path that starts a GEMM also waits for it)
                    issue(c, it[0], qb, k_s, q_s, logits, k_ready, True)
                    for kp in T.serial((tiles[0] - 1) // 2):  # tiles 2kp (in flight), 2kp+1, 2kp+2 exist
                        issue(c, it[0] + 1, qb, k_s, q_s, logits_b, k_ready, True)
                        T.wait_wgmma(1)
                        release(c, it[0], ks_s, ks_f, k_free)
                        epilogue(c, 2 * kp, *args, logits, part, row, ks_f, w_f, win, first)
                        issue(c, it[0] + 2, qb, k_s, q_s, logits, k_ready, True)
                        T.wait_wgmma(1)
                        release(c, it[0] + 1, ks_s, ks_f, k_free)
                        epilogue(c, 2 * kp + 1, *args, logits_b, part, row, ks_f, w_f, win, first)
                        it[0] = it[0] + 2
                    if tiles[0] % 2 == 0:  # the last two tiles
                        issue(c, it[0] + 1, qb, k_s, q_s, logits_b, k_ready, True)
                        T.wait_wgmma(1)
                        release(c, it[0], ks_s, ks_f, k_free)
                        epilogue(c, tiles[0] - 2, *args, logits, part, row, ks_f, w_f, win, first)
                        T.wait_wgmma(0)
                        release(c, it[0] + 1, ks_s, ks_f, k_free)
                        epilogue(c, tiles[0] - 1, *args, logits_b, part, row, ks_f, w_f, win, first)
                        it[0] = it[0] + 2
                    else:  # the last tile
                        T.wait_wgmma(0)
                        release(c, it[0], ks_s, ks_f, k_free)
                        epilogue(c, tiles[0] - 1, *args, logits, part, row, ks_f, w_f, win, first)
                        it[0] = it[0] + 1
            else:
                for kt in T.serial(tiles[0]):
                    issue(c, it[0], qb, k_s, q_s, logits, k_ready, False)
                    release(c, it[0], ks_s, ks_f, k_free)  # (the scales before the stage is handed back)
                    epilogue(c, kt, *args, logits, part, row, ks_f, w_f, win, first)
                    it[0] = it[0] + 1
            T.barrier_arrive(q_free[qb])  # every GEMM of the pair has read its queries

    @T.macro
    def body(Q, QS, K, KS, W, Starts, Ends, Scores):
        nqb = T.ceildiv(num_q, BLOCK_Q)
        G = T.min(grid, nqb)
        with T.Kernel(G, threads=128 * (consumers + 1)) as bx:
            q_s = T.alloc_shared((2, BLOCK_Q * heads, dim), dtype)  # query qi's heads on rows qi*H_I ...
            k_s = T.alloc_shared((stages, block_n, dim), dtype)
            ks_s = T.alloc_shared((stages, block_n), f32)  # fp8: the keys' scales (a bulk-copy target: aligned)
            w_s = T.alloc_shared((2, BLOCK_Q, heads), f32, scope="shared")
            meta_s = T.alloc_shared((2, 8), "int32", scope="shared")
            logits = [T.alloc_fragment((SUB, BLOCK_Q * heads), f32) for _ in range(consumers)]  # [keys, (q, h)]
            logits_b = [T.alloc_fragment((SUB, BLOCK_Q * heads), f32) if pingpong else None
                        for _ in range(consumers)]  # pingpong: the second accumulator
            # per thread (see `epilogue`): its partial sums (two per score), the reduce-scatter's middle step, the scale
            # of the key it stores (fp8) and its heads' weights of both queries
            part = [T.alloc_local((4 * BLOCK_Q,), f32) for _ in range(consumers)]
            row = [T.alloc_local((2,), f32) for _ in range(consumers)]
            ks_f = [T.alloc_local((1,), f32) for _ in range(consumers)]
            w_f = [T.alloc_local((BLOCK_Q * heads // 4,), f32) for _ in range(consumers)]
            win = T.alloc_local((2 * BLOCK_Q,), "int32")
            # the accumulators keep the warpgroup MMA's register layout, which `epilogue` reads per thread
            T.annotate_layout({acc: wgmma_layout(heads) for acc in logits + logits_b if acc is not None})
            q_ready = T.alloc_barrier(arrive_count=[2 * PREPARERS] * 2)  # the preparers' cp.async arrivals + plain ones
            q_free = T.alloc_barrier(arrive_count=[128 * consumers] * 2)
            k_ready = T.alloc_barrier(arrive_count=[1] * stages)  # the loader's one arrival (and the stage's bytes)
            k_free = T.alloc_barrier(arrive_count=[128 * consumers] * stages)
            it = T.alloc_local((1,), "int32")
            first = T.alloc_local((1,), "int32")
            tiles = T.alloc_local((1,), "int32")
            nxt_first = T.alloc_local((1,), "int32")  # the preparers': the next pair's
            nxt_tiles = T.alloc_local((1,), "int32")
            win_n = T.alloc_local((2 * BLOCK_Q,), "int32")  # the loader's: the next pair's windows
            tx = T.get_thread_binding()
            n_pairs = T.ceildiv(nqb - bx, G)

            bars = (q_ready, q_free, k_ready, k_free, it, first, tiles)
            common = (bx, nqb, G, n_pairs, Scores, q_s, w_s, meta_s, k_s, ks_s)
            regs = consumer_regs(consumers)
            if tx < 128:
                T.set_max_nreg(regs, 1)
                consume(0, *common, logits[0], logits_b[0], part[0], row[0], ks_f[0], w_f[0], win, *bars)
            elif tx < 256:
                T.set_max_nreg(regs, 1)
                consume(1, *common, logits[1], logits_b[1], part[1], row[1], ks_f[1], w_f[1], win, *bars)
            elif tx < 128 * consumers:  # (consumers 2 and 3 of three or four)
                T.set_max_nreg(regs, 1)
                if consumers == 3:
                    consume(2, *common, logits[2], logits_b[2], part[2], row[2], ks_f[2], w_f[2], win, *bars)
                elif consumers == 4:
                    if tx < 384:
                        consume(2, *common, logits[2], logits_b[2], part[2], row[2], ks_f[2], w_f[2], win, *bars)
                    else:
                        consume(3, *common, logits[3], logits_b[3], part[3], row[3], ks_f[3], w_f[3], win, *bars)
            else:  # the last warpgroup: the loader warp, then the preparers
                T.set_max_nreg(LAST_WARPGROUP_REGS, 0)
                if tx < 128 * consumers + 32:
                    load_all(bx, nqb, G, n_pairs, K, KS, Starts, Ends, k_s, ks_s, k_ready, k_free, it, first, tiles,
                             win_n)
                else:
                    prepare_all(tx - 128 * consumers - 32, bx, nqb, G, n_pairs, Q, QS, W, Starts, Ends, Scores, q_s,
                                w_s, meta_s, q_ready, q_free, first, tiles, nxt_first, nxt_tiles)

    return tilelang.compile(score_prim_func(body, heads, dim, fp8, num_q, num_kv), pass_configs=_PASS,
                            target=compile_target())
# --8<-- [end:indexer_persistent_kernel]
