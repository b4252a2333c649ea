"""Fair sharing between tenants (issue 18): a light tenant's TTFT while a heavy tenant floods the same tier.

Offline, on one loaded model (the in-process ``LLMEngine``; random token-id prompts, outputs of 0.5x-1.5x
``max_tokens``, greedy, ``ignore_eos``; both tenants on the interactive tier):

1. ``alone``: the light tenant's requests one after another on an idle engine (its baseline TTFT);
2. ``fair off`` / ``fair on``: the heavy tenant keeps a standing queue (3x the engine's seats outstanding) and
   a light request arrives each time 10 more heavy requests have finished: the heavy tenant submits 10x the
   requests, and the engine is saturated throughout. The scheduler's fair share (``Scheduler.set_fair_share``)
   is off, then on, on fresh engines sharing the model.

Reported: the light tenant's TTFT p50/p95 in each run (TTFT = first token - when the request was added),
and output throughput with fair share on / off (tokens over the run's wall time; the engine's step counts,
which timing noise does not touch, too). The same three runs are also replayed on the real scheduler with a
fake model (``SimulatedEngine``), TTFT counted in steps: what the admission order alone does, apart from how
much slower a loaded step is than an idle one on this machine.
Targets (issue 18): light TTFT p95 with fair share on within 2x of alone; throughput within 5% of off.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from bench import common

HEAVY_RATIO = 10  # heavy requests per light request


Item = tuple[list[int], int]  # (prompt token ids, max_tokens)


def _items(vocab: int, n: int, rng: random.Random, prompt_len: tuple[int, int], max_tokens: int) -> list[Item]:
    """Random prompts; outputs of 0.5x to 1.5x ``max_tokens``, so requests admitted together do not all end
    together (lockstep waves of admissions would make every step that admits a request a wave of prefills)."""
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))],
             rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2)) for _ in range(n)]


class SimulatedEngine:
    """The real scheduler and block manager with a fake model (every chunk that completes a request's tokens
    samples token 7): the same runs with time counted in steps, free of the noise of a shared machine."""

    def __init__(self, max_num_seqs: int, max_batched_tokens: int, fair: bool) -> None:
        from scheduler.block_manager import BlockManager
        from scheduler.scheduler import Scheduler, SchedulerConfig

        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                                                   fair_share=fair), BlockManager(4096, 16, True))
        self.stats = SimpleNamespace(steps=0, busy_seconds=0.0)

    def clock(self) -> float:
        return float(self.stats.steps)

    def add_request(self, req) -> None:
        self.scheduler.add_request(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list:
        out = self.scheduler.schedule()
        sampled = [7 if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled]
        ended = {id(r) for r in self.scheduler.postprocess(out, sampled)}
        self.stats.steps += 1
        return [SimpleNamespace(request_id=r.request_id, new_token_ids=[] if t is None else [t], finished=id(r) in ended)
                for (r, _), t in zip(out.scheduled, sampled, strict=True)]


class _Run:
    """One engine run: adds requests, steps, and records each request's TTFT (first token - when it was
    added: arrivals happen between steps, so the step an arrival waits for counts) and the output tokens."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # seconds, or steps for the simulation (no wall clock there)
        self.clock = engine.clock if isinstance(engine, SimulatedEngine) else time.perf_counter
        self.added: dict[str, tuple[str, float]] = {}  # request id -> (tenant, time added)
        self.ttft: dict[str, float] = {}
        self.finished: Counter = Counter()  # per tenant
        self.tokens = 0
        self.t0 = self.clock()

    def add(self, tenant: str, item: Item) -> None:
        from scheduler.request import Request, SamplingParams, Tier

        rid = f"{tenant}-{len(self.added)}"
        self.added[rid] = (tenant, self.clock())
        sampling = SamplingParams(max_tokens=item[1], temperature=0.0, ignore_eos=True)
        self.engine.add_request(Request(rid, list(item[0]), sampling, tier=Tier.INTERACTIVE, tenant=tenant))

    def outstanding(self, tenant: str) -> int:
        return sum(t == tenant for t, _ in self.added.values()) - self.finished[tenant]

    def step(self) -> None:
        outs = self.engine.step()
        now = self.clock()
        for o in outs:
            self.tokens += len(o.new_token_ids or [])
            tenant, added = self.added[o.request_id]
            if o.new_token_ids and o.request_id not in self.ttft:
                self.ttft[o.request_id] = now - added
            self.finished[tenant] += o.finished

    def result(self) -> dict:
        """The raw numbers (pooled over repeats by ``summarise``)."""
        ttft = {"light": [], "heavy": []}
        for rid, value in self.ttft.items():
            ttft[self.added[rid][0]].append(value)
        return {"wall_s": self.clock() - self.t0, "busy_s": self.engine.stats.busy_seconds,
                "steps": self.engine.stats.steps, "output_tokens": self.tokens, **ttft}


def summarise(raws: list[dict]) -> dict:
    """One row from a mode's runs: TTFTs pooled, throughput = all tokens over all wall (or busy) time."""
    light, heavy = [v for r in raws for v in r["light"]], [v for r in raws for v in r["heavy"]]
    tokens, wall, busy, steps = (sum(r[k] for r in raws) for k in ("output_tokens", "wall_s", "busy_s", "steps"))
    return {"runs": len(raws), "light_requests": len(light), "heavy_requests": len(heavy), "wall_s": wall, "steps": steps,
            "output_tokens": tokens, "output_tok_s": tokens / wall, "busy_tok_s": tokens / busy if busy else None,
            "light_ttft_p50_s": common.percentile(light, 50), "light_ttft_p95_s": common.percentile(light, 95),
            "heavy_ttft_p50_s": common.percentile(heavy, 50), "heavy_ttft_p95_s": common.percentile(heavy, 95)}


def alone(engine, light: list[Item]) -> dict:
    """The light tenant's requests one after another on an otherwise idle engine: its baseline TTFT."""
    run = _Run(engine)
    for item in light:
        run.add("light", item)
        while engine.has_unfinished():
            run.step()
    return run.result()


def loaded(engine, light: list[Item], heavy: list[Item], backlog: int) -> dict:
    """The heavy tenant keeps ``backlog`` requests outstanding (more than the engine runs at once: a standing
    queue); a light request arrives each time ``HEAVY_RATIO`` more heavy requests have finished, so the heavy
    tenant submits 10x the light one's requests whatever the machine's speed. Ends when all are done."""
    run = _Run(engine)
    heavy_iter, n_light = iter(heavy), 0
    while n_light < len(light) or engine.has_unfinished():
        if n_light < len(light):
            while run.outstanding("heavy") < backlog and (item := next(heavy_iter, None)) is not None:
                run.add("heavy", item)
            if run.finished["heavy"] >= HEAVY_RATIO * (n_light + 1):
                run.add("light", light[n_light])
                n_light += 1
        run.step()
    return run.result()


def simulate(light: list[Item], heavy: list[Item], backlog: int, max_num_seqs: int) -> dict:
    """The three runs on ``SimulatedEngine``: TTFTs in steps (``*_s`` keys hold steps here)."""
    rows = {"alone": alone(SimulatedEngine(max_num_seqs, 512, True), light)}
    for name, fair in (("fair off", False), ("fair on", True)):
        rows[name] = loaded(SimulatedEngine(max_num_seqs, 512, fair), light, heavy, backlog)
    return {name: summarise([r]) for name, r in rows.items()}


def run(model: str | None = None, *, dtype: str = "float32", light_requests: int = 24, max_num_seqs: int = 8,
        max_tokens: int = 16, prompt_len: tuple[int, int] = (16, 64), repeats: int = 1, seed: int = 0,
        kv_cache_memory: str = "512MiB", out: str | Path | None = None, tag: str = "fairness", log=print) -> dict:
    from bench.engines import InferqOffline

    model_dir = common.resolve_model_dir(model)
    info = common.machine_info(dtype)
    log(common.machine_line(info))
    t_start, load_start = time.perf_counter(), os.getloadavg()
    base = InferqOffline(model_dir, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                         max_batched_tokens=512)
    rng = random.Random(seed)
    vocab, backlog = base.info.vocab_size, 3 * max_num_seqs
    light = _items(vocab, light_requests, rng, prompt_len, max_tokens)
    heavy = _items(vocab, HEAVY_RATIO * light_requests + backlog, rng, prompt_len, max_tokens)
    simulated = simulate(light, heavy, backlog, max_num_seqs)
    log("simulated (TTFT in steps): " + "; ".join(f"{name} p50 {r['light_ttft_p50_s']:.0f}, p95 {r['light_ttft_p95_s']:.1f}"
                                                  for name, r in simulated.items()))
    alone(base.new_engine(), _items(vocab, 2, rng, prompt_len, max_tokens))  # warm-up: first steps cost more
    raws: dict[str, list[dict]] = {"alone": [], "fair off": [], "fair on": []}
    for _ in range(repeats):  # alternating, so a noisy neighbour hits every mode alike
        for name in raws:
            fair = name != "fair off"
            engine = base.new_engine(fair_share=fair)
            engine.scheduler.set_fair_share(fair)  # whatever the engine's settings passed to its scheduler
            raws[name].append(alone(engine, light) if name == "alone" else loaded(engine, light, heavy, backlog))
            r = summarise(raws[name][-1:])
            log(f"{name}: light TTFT p50 {r['light_ttft_p50_s'] * 1000:.0f} ms, p95 "
                f"{r['light_ttft_p95_s'] * 1000:.0f} ms; {r['output_tok_s']:.1f} tok/s over {r['wall_s']:.1f} s")
    result = _result({name: summarise(r) for name, r in raws.items()}, info, model_dir,
                     {"light_requests": light_requests, "heavy_backlog": backlog, "max_num_seqs": max_num_seqs,
                      "max_tokens": max_tokens, "prompt_len": prompt_len, "heavy_ratio": HEAVY_RATIO,
                      "repeats": repeats, "dtype": dtype})
    result["simulated_steps"] = simulated
    in_steps = simulated["fair on"]["light_ttft_p95_s"] / simulated["alone"]["light_ttft_p95_s"]
    result["targets"].append({"target": "the same in engine steps (scheduling alone, fake model): <= 2x alone",
                              "measured": in_steps, "met": in_steps <= 2.0})
    result.update(elapsed_s=time.perf_counter() - t_start, loadavg_start=load_start, loadavg_end=os.getloadavg())
    common.write_json(common.results_dir(out), tag, result)
    log(report(result))
    return result


def _result(rows_by_name: dict, info: dict, model_dir: Path, settings: dict) -> dict:
    alone_p95 = rows_by_name["alone"]["light_ttft_p95_s"]
    rows = [{"run": name, **r, "light_p95_vs_alone": r["light_ttft_p95_s"] / alone_p95 if alone_p95 else None}
            for name, r in rows_by_name.items()]
    on_vs_alone = rows[2]["light_p95_vs_alone"]
    ratio = rows_by_name["fair on"]["output_tok_s"] / rows_by_name["fair off"]["output_tok_s"]
    targets = [{"target": "light tenant TTFT p95, fair share on: <= 2x alone", "measured": on_vs_alone,
                "met": on_vs_alone is not None and on_vs_alone <= 2.0},
               {"target": "throughput, fair share on / off: >= 0.95", "measured": ratio, "met": ratio >= 0.95}]
    return {"benchmark": "fairness", "machine": info, "model": str(model_dir), "rows": rows,
            "throughput_on_off": ratio, "targets": targets, "settings": settings}


def report(result: dict) -> str:
    rows = [{**r, **{k: r[k] * 1000 for k in r if "ttft" in k and r[k] is not None}} for r in result["rows"]]
    sim = [{"run": name, **r} for name, r in result["simulated_steps"].items()]
    by_name = {r["run"]: r for r in result["rows"]}
    lines = [common.machine_line(result["machine"]),
             common.table(rows, [("run", "run"), ("light_requests", "light"), ("heavy_requests", "heavy"),
                                 ("light_ttft_p50_s", "light TTFT p50 ms"), ("light_ttft_p95_s", "light TTFT p95 ms"),
                                 ("light_p95_vs_alone", "p95 / alone"), ("heavy_ttft_p95_s", "heavy TTFT p95 ms"),
                                 ("output_tok_s", "tok/s"), ("busy_tok_s", "tok/busy s"), ("steps", "steps"),
                                 ("wall_s", "wall s")]),
             f"throughput fair on / off: {result['throughput_on_off']:.3f} (engine steps on / off: "
             f"{by_name['fair on']['steps'] / by_name['fair off']['steps']:.3f})",
             "scheduler alone, fake model (TTFT in steps, no timing noise):",
             common.table(sim, [("run", "run"), ("light_ttft_p50_s", "light TTFT p50 steps"),
                                ("light_ttft_p95_s", "light TTFT p95 steps"), ("heavy_ttft_p95_s", "heavy TTFT p95 steps"),
                                ("steps", "steps")])]
    for t in result["targets"]:
        lines.append(common.target_line(t["target"], "", t["measured"], t["met"]))
    lines.append(f"elapsed {result['elapsed_s']:.0f} s")
    return "\n".join(lines)
