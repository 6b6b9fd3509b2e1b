"""Barrier protocols of the warp-specialised kernels, checked on the CPU.

* the staggered sparse MLA forward (`dsa_ref.kernels.sparse_mla_fwd.staggered_kernel`): a producer
  and two consumer warpgroups over half-stages of shared memory, the maxima and ``P`` swapped
  between them (``P_0`` in stage 0's rope buffer, handed over by named barriers), each stage's
  validity flags read before its scores are computed;
* the warp-specialised fp8 indexer (commit 8d897a9; `git revert 5703802`): a producer filling a ring
  of key tiles, two consumers taking turns on the tensor cores (ping-pong).

Each model runs the warpgroups' programs as Python generators under random interleavings, with
mbarrier semantics (arrive counts, phases, waits on a phase's parity), named barriers of two
warpgroups (``bar.arrive`` / ``bar.sync``) and a version on every buffer, and raises on a deadlock,
on a read of a buffer that holds other data, on a write while a read (an issued, not yet
waited-for tensor-core product) is in flight, on a warpgroup arriving twice at a named barrier in
one generation, and (fp8 indexer) on both consumers on the tensor cores at once. Each warpgroup's
128 arrivals count as one here. Broken protocols are caught (the staggered forward's are run at the
end: the pair count read before it is written, flags read after their half is handed back, ``P_0``
read without its named barrier, a half handed back before its last product is waited for);
`tests/test_barrier_models.py` runs both models.

    python tools/probes/barrier_models.py
"""
import random

class Bar:
    def __init__(self, n): self.n, self.count, self.phase = n, 0, 0  # phase = number of completed phases
    def arrive(self):
        self.count += 1
        if self.count == self.n: self.count, self.phase = 0, self.phase + 1
    def done(self, parity):  # try_wait.parity(P): true once a phase with parity P has completed
        # current in-progress phase index = self.phase; completed phases 0..phase-1; phase "-1" counts as done
        # PTX: waiting on parity P succeeds iff the current phase's parity != P
        return (self.phase & 1) != parity

class Buf:
    def __init__(self, name): self.name, self.version, self.writing, self.readers = name, None, False, 0

class Hazard(Exception): pass

class Named:
    """A named barrier of two warpgroups (``bar.arrive`` / ``bar.sync``, 256 threads): each
    warpgroup adds one arrival; a sync waits for the generation it joined to complete. A second
    arrival of the same warpgroup in one generation would complete it without the other one."""
    def __init__(self, name): self.name, self.arrived, self.generation = name, set(), 0
    def arrive(self, who):
        if who in self.arrived: raise Hazard(f"{who} arrives twice at {self.name} in one generation")
        self.arrived.add(who)
        if len(self.arrived) == 2: self.arrived, self.generation = set(), self.generation + 1
        return self.generation if not self.arrived else self.generation + 1  # the generation to wait for


def run(n, seed, mutation=None):
    """One block of the staggered forward (`staggered_kernel`) over ``n`` pairs of 64-row blocks.

    Both consumers first count the pairs (their halves of the row's slots, into ``count_s``), and
    every warpgroup reads the count after ``count_ready``.

    ``mutation`` breaks the protocol on purpose (the model must then raise): ``"count_early"`` lets
    the producer read the count without waiting for ``count_ready``, ``"flags_late"`` reads
    stage 0's validity flags after its first half is handed back, ``"no_p_sync"`` lets consumer 1
    read ``P_0`` without its named barrier, ``"free_early"`` hands stage 1's first half back before
    consumer 0's last product from it is waited for."""
    rnd = random.Random(seed)
    B = dict(q_ready=Bar(3), l_ready=Bar(2), count_ready=Bar(2),
             kv_ready=[Bar(1) for _ in range(4)], kv_free=[Bar(1) for _ in range(4)],
             max_ready=[Bar(1), Bar(1)])
    P_READY = [Named("P_READY"), Named("P_READY + 1")]
    half = {h: Buf(h) for h in ("0L", "0R", "1L", "1R")}
    rope0 = Buf("stage 0's rope buffer (P0)")  # copied with 0R: its rope channels, then P_0
    valid = [Buf("valid_s[0]"), Buf("valid_s[1]")]
    q = Buf("q_s (Q, then the output)")
    p1 = Buf("P1"); m0 = Buf("max0"); m1 = Buf("max1"); l0 = Buf("l_s[0]"); l1 = Buf("l_s[1]")
    counts = [Buf("count_s[0:4]"), Buf("count_s[4:8]")]  # each consumer's warps' pair counts
    idx = {"0L": 0, "0R": 1, "1L": 2, "1R": 3}

    def wait(bar, parity):
        while not bar.done(parity): yield "blocked"
    def sync(nb, who):
        gen = nb.arrive(who)
        while nb.generation < gen: yield "blocked"
    def w_start(buf):
        if buf.readers: raise Hazard(f"write of {buf.name} while {buf.readers} read(s) in flight")
        buf.writing = True
    def w_end(buf, v): buf.writing, buf.version = False, v
    def r_start(buf, v):
        if buf.writing or buf.version != v: raise Hazard(f"read of {buf.name} for {v}: holds {buf.version}, writing={buf.writing}")
        buf.readers += 1
    def r_end(buf, v):
        if buf.version != v or buf.writing: raise Hazard(f"{buf.name} changed under an in-flight read of {v}")
        buf.readers -= 1
    def write(buf, v): w_start(buf); w_end(buf, v)
    def read(buf, v): r_start(buf, v); r_end(buf, v)

    def read_count():  # every warpgroup reads both consumers' counts after count_ready
        if mutation != "count_early":
            yield from wait(B["count_ready"], 0)
        read(counts[0], n); read(counts[1], n)
    def count(c):  # consumer c counts the pairs of its half of the slots
        write(counts[c], n); B["count_ready"].arrive(); yield "ok"
    def producer():
        w_start(q); yield "tma"; w_end(q, "Q"); B["q_ready"].arrive()
        yield from read_count()
        for it in range(n):
            for h in ("0L", "1R", "0R", "1L"):
                yield from wait(B["kv_free"][idx[h]], (it & 1) ^ 1)
                w_start(half[h])
                if h == "0R": w_start(rope0)
                if h in ("0L", "1R"): w_start(valid[int(h[0])])  # a stage's first half carries its flags
                yield "copying"
                w_end(half[h], it)
                if h == "0R": w_end(rope0, it)
                if h in ("0L", "1R"): w_end(valid[int(h[0])], it)
                B["kv_ready"][idx[h]].arrive(); yield "ok"
    def scores0(it):  # S_0 = Q K_0^T issued: the flags are read first (the accumulator starts at -inf there)
        yield from wait(B["kv_ready"][0], it & 1)
        if mutation != "flags_late": read(valid[0], it)
        r_start(half["0L"], it); r_start(q, "Q")
        yield from wait(B["kv_ready"][1], it & 1); r_start(half["0R"], it); r_start(rope0, it)
    def wg0():
        yield from count(0); yield from read_count()
        B["q_ready"].arrive(); yield from wait(B["q_ready"], 0)
        if n > 0:
            yield from scores0(0)
        for it in range(n):
            r_end(half["0L"], it); r_end(half["0R"], it); r_end(rope0, it); r_end(q, "Q")  # wait_wgmma(0): S_0
            write(m0, it); B["max_ready"][0].arrive(); yield "ok"
            r_start(half["0L"], it); yield "pv"; r_end(half["0L"], it)  # O_L += P0 V0L, waited
            B["kv_free"][0].arrive(); yield "ok"
            if mutation == "flags_late": read(valid[0], it)
            yield from wait(B["max_ready"][1], it & 1); read(m1, it)
            if rope0.version != it: raise Hazard("P0 written into the rope buffer of another pair")
            write(rope0, ("P0", it)); yield "ok"
            P_READY[0].arrive("wg0"); yield "ok"
            yield from sync(P_READY[1], "wg0")
            r_start(p1, it); r_start(half["1L"], it); yield "pv"  # O_L += P1 V1L in flight
            if it + 1 < n:
                if mutation == "free_early":
                    B["kv_free"][2].arrive(); yield "ok"
                yield from scores0(it + 1)
                r_end(p1, it); r_end(half["1L"], it)  # wait_wgmma(1)
                if mutation != "free_early":
                    B["kv_free"][2].arrive(); yield "ok"
            else:
                r_end(p1, it); r_end(half["1L"], it); B["kv_free"][2].arrive(); yield "ok"
        write(l0, 0); B["l_ready"].arrive(); yield from wait(B["l_ready"], 0); read(l1, 0)
        write(q, "O_L"); yield "stored"
    def wg1():
        yield from count(1); yield from read_count()
        B["q_ready"].arrive(); yield from wait(B["q_ready"], 0)
        for it in range(n):
            yield from wait(B["kv_ready"][3], it & 1); read(valid[1], it); r_start(half["1R"], it); r_start(q, "Q")
            yield from wait(B["kv_ready"][2], it & 1); r_start(half["1L"], it); yield "qk"
            r_end(half["1R"], it); r_end(half["1L"], it); r_end(q, "Q")
            yield from wait(B["max_ready"][0], it & 1); read(m0, it)
            write(m1, it); B["max_ready"][1].arrive(); yield "ok"
            r_start(half["1R"], it); yield "pv"  # O_R += P1 V1R in flight
            write(p1, it); yield "ok"
            if mutation != "no_p_sync":
                yield from sync(P_READY[0], "wg1")
            r_start(rope0, ("P0", it)); r_start(half["0R"], it); yield "pv"
            P_READY[1].arrive("wg1"); yield "ok"
            r_end(half["1R"], it); B["kv_free"][3].arrive(); yield "ok"  # wait_wgmma(1)
            r_end(rope0, ("P0", it)); r_end(half["0R"], it); B["kv_free"][1].arrive(); yield "ok"  # wait_wgmma(0)
        write(l1, 0); B["l_ready"].arrive(); yield from wait(B["l_ready"], 0); read(l0, 0)
        yield "stored"  # O_R into q_s beside O_L (after l_ready: every product has read Q)

    actors = {"producer": producer(), "wg0": wg0(), "wg1": wg1()}
    steps = 0
    while actors:
        names = list(actors); rnd.shuffle(names)
        progressed = False
        for name in names:
            try:
                r = next(actors[name])
            except StopIteration:
                del actors[name]; progressed = True; break
            if r != "blocked":
                progressed = True; break
        steps += 1
        if not progressed:
            # everyone reported blocked once; try a full round to be sure
            if all(next(actors[nm], "done") == "blocked" for nm in list(actors)):
                raise Hazard(f"deadlock with {sorted(actors)} left")
        if steps > 200000: raise Hazard("no end")
    return True

def run_fp8(n_tiles, seed, stages=4):
    rnd = random.Random(seed)
    q_ready = Bar(3)
    kv_ready = [Bar(1) for _ in range(stages)]
    kv_free = [Bar(2) for _ in range(stages)]
    turn = [Bar(1), Bar(1)]
    ring = [Buf(f"stage {i}") for i in range(stages)]
    mma_busy = [None]

    def wait(bar, parity):
        while not bar.done(parity): yield "blocked"
    def producer():
        q_ready.arrive()
        for kt in range(n_tiles):
            st = kt % stages
            yield from wait(kv_free[st], ((kt // stages) & 1) ^ 1)
            if ring[st].readers: raise Hazard(f"tile {kt} overwrites stage {st} under a read")
            ring[st].writing = True; yield "copy"; ring[st].writing = False; ring[st].version = kt
            kv_ready[st].arrive(); yield "ok"
    def consumer(c):
        q_ready.arrive(); yield from wait(q_ready, 0)
        for kt in range(n_tiles):
            st = kt % stages
            yield from wait(kv_ready[st], (kt // stages) & 1)
            yield from wait(turn[c], (kt & 1) ^ (1 - c))
            if ring[st].version != kt or ring[st].writing: raise Hazard(f"consumer {c} reads tile {kt}: stage holds {ring[st].version}")
            if mma_busy[0] is not None: raise Hazard(f"both consumers on the tensor cores ({mma_busy[0]} and {c})")
            ring[st].readers += 1; mma_busy[0] = c; yield "gemm"
            mma_busy[0] = None; ring[st].readers -= 1
            turn[1 - c].arrive(); kv_free[st].arrive(); yield "epilogue"
    actors = {"p": producer(), "c0": consumer(0), "c1": consumer(1)}
    while actors:
        names = list(actors); rnd.shuffle(names); progressed = False
        for nm in names:
            try:
                r = next(actors[nm])
            except StopIteration:
                del actors[nm]; progressed = True; break
            if r != "blocked": progressed = True; break
        if not progressed and all(next(actors[nm], "done") == "blocked" for nm in list(actors)):
            raise Hazard(f"deadlock: {sorted(actors)}")



if __name__ == "__main__":
    for n in range(0, 7):
        for seed in range(400):
            run(n, seed)
    print("staggered forward: no deadlock, no hazard for 0..6 pairs, 400 interleavings each")
    for mutation in ("count_early", "flags_late", "no_p_sync", "free_early"):
        caught = 0
        for seed in range(200):
            try:
                run(3, seed, mutation)
            except Hazard:
                caught += 1
        print(f"  mutation {mutation}: caught in {caught} of 200 interleavings")
        assert caught, mutation
    for n in range(0, 12):
        for seed in range(300):
            run_fp8(n, seed)
    print("fp8 indexer, warp-specialised: no deadlock, no hazard, never both consumers on the tensor cores, "
          "0..11 tiles, 300 interleavings each")
