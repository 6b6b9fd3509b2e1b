"""Barrier protocols of the warp-specialised kernels that have not run on a GPU yet, checked on the CPU.

Two kernels in this repository's history (compiled for sm_90a, reverted until they have run on a GPU):

* the staggered sparse MLA forward (commit f532410; `git revert 518831e` brings it back): a producer and
  two consumer warpgroups over half-stages of shared memory, the maxima and ``P`` swapped between them;
* the warp-specialised fp8 indexer (commit 8d897a9; `git revert 5703802`): a producer filling a ring
  of key tiles, two consumers taking turns on the tensor cores (ping-pong).

Each model runs the warpgroups' programs as Python generators under random interleavings, with
mbarrier semantics (arrive counts, phases, waits on a phase's parity) and a version on every buffer,
and raises on a deadlock, on a read of a buffer that holds other data, on a write while a read
(an issued, not yet waited-for tensor-core product) is in flight, and (fp8 indexer) on both consumers
on the tensor cores at once. Each warpgroup's 128 arrivals count as one here. Mutations of the
protocols (a half freed before its product is waited for, a maximum read without its barrier, an
arrival too many, a wrong turn parity) are caught.

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

def run(n, seed):
    rnd = random.Random(seed)
    B = dict(q_ready=Bar(3), l_ready=Bar(2),
             kv_ready=[Bar(1) for _ in range(4)], kv_free=[Bar(1) for _ in range(4)],
             max_ready=[Bar(1), Bar(1)], p_ready=[Bar(1), Bar(1)])
    half = {h: Buf(h) for h in ("0L", "0R", "1L", "1R")}
    p0 = Buf("P0 (in 0R's rope columns)"); p1 = Buf("P1"); m0 = Buf("max0"); m1 = Buf("max1")
    idx = {"0L": 0, "0R": 1, "1L": 2, "1R": 3}

    def wait(bar, parity):
        while not bar.done(parity): yield "blocked"
    def w_start(buf):
        if buf.readers: raise Hazard(f"write of {buf.name} while {buf.readers} read(s) in flight")
        buf.writing = True
    def w_end(buf, v): buf.writing, buf.version = False, v
    def r_start(buf, v):
        if buf.writing or buf.version != v: raise Hazard(f"read of {buf.name} for pair {v}: holds {buf.version}, writing={buf.writing}")
        buf.readers += 1
    def r_end(buf, v):
        if buf.version != v or buf.writing: raise Hazard(f"{buf.name} changed under an in-flight read of pair {v}")
        buf.readers -= 1
    def write(buf, v): w_start(buf); w_end(buf, v)
    def read(buf, v): r_start(buf, v); r_end(buf, v)

    def producer():
        B["q_ready"].arrive()
        for it in range(n):
            for h in ("0L", "1R", "0R", "1L"):
                yield from wait(B["kv_free"][idx[h]], (it & 1) ^ 1)
                w_start(half[h]); yield "copying"
                w_end(half[h], it); B["kv_ready"][idx[h]].arrive(); yield "ok"
    def wg0():
        B["q_ready"].arrive(); yield from wait(B["q_ready"], 0)
        if n > 0:
            yield from wait(B["kv_ready"][0], 0); r_start(half["0L"], 0)
            yield from wait(B["kv_ready"][1], 0); r_start(half["0R"], 0)
        for it in range(n):
            r_end(half["0L"], it); r_end(half["0R"], it)  # wait_wgmma(0): S_0 done
            write(m0, it); B["max_ready"][0].arrive(); yield "ok"
            r_start(half["0L"], it); yield "pv"; r_end(half["0L"], it)  # O_L += P0 V0L, waited
            B["kv_free"][0].arrive(); yield "ok"
            yield from wait(B["max_ready"][1], it & 1); read(m1, it)
            w_start(p0); yield "ok"; w_end(p0, it)  # P0 into 0R's rope columns (0R must hold pair it)
            if half["0R"].version != it: raise Hazard("P0 written into 0R of another pair")
            B["p_ready"][0].arrive(); yield "ok"
            yield from wait(B["p_ready"][1], it & 1)
            r_start(p1, it); r_start(half["1L"], it); yield "pv"  # O_L += P1 V1L in flight
            if it + 1 < n:
                yield from wait(B["kv_ready"][0], (it + 1) & 1); r_start(half["0L"], it + 1)
                r_end(p1, it); r_end(half["1L"], it); B["kv_free"][2].arrive(); yield "ok"  # wait_wgmma(1)
                yield from wait(B["kv_ready"][1], (it + 1) & 1); r_start(half["0R"], it + 1)
            else:
                r_end(p1, it); r_end(half["1L"], it); B["kv_free"][2].arrive(); yield "ok"
        B["l_ready"].arrive(); yield from wait(B["l_ready"], 0)
    def wg1():
        B["q_ready"].arrive(); yield from wait(B["q_ready"], 0)
        for it in range(n):
            yield from wait(B["kv_ready"][3], it & 1); r_start(half["1R"], it)
            yield from wait(B["kv_ready"][2], it & 1); r_start(half["1L"], it); yield "qk"
            r_end(half["1R"], it); r_end(half["1L"], it)
            yield from wait(B["max_ready"][0], it & 1); read(m0, it)
            write(m1, it); B["max_ready"][1].arrive(); yield "ok"
            r_start(half["1R"], it); yield "pv"  # O_R += P1 V1R in flight
            write(p1, it); yield "ok"
            yield from wait(B["p_ready"][0], it & 1)
            r_start(p0, it); r_start(half["0R"], it); yield "pv"
            B["p_ready"][1].arrive(); yield "ok"
            r_end(half["1R"], it); B["kv_free"][3].arrive(); yield "ok"  # wait_wgmma(1)
            r_end(p0, it); r_end(half["0R"], it); B["kv_free"][1].arrive(); yield "ok"  # wait_wgmma(0)
        B["l_ready"].arrive(); yield from wait(B["l_ready"], 0)

    actors = {"producer": producer(), "wg0": wg0(), "wg1": wg1()}
    pending = {k: None for k in actors}
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
        if steps > 100000: raise Hazard("no end")
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
    for n in range(0, 12):
        for seed in range(300):
            run_fp8(n, seed)
    print("fp8 indexer, warp-specialised: no deadlock, no hazard, never both consumers on the tensor cores, "
          "0..11 tiles, 300 interleavings each")
