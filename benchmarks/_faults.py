"""Chaos: a 2-process training run killed at random points, resumed each time, checked step for step.

    python -m benchmarks._faults --kills 10 --seed 0 --write

runs `tests/_dist_worker.py train` (the reference GPT, 2-D preset, 2 processes x 4 simulated
devices, Adam, an async checkpoint every `--every` steps) under `jshard launch`: once uninterrupted
(the reference), then again and again from the same checkpoint directory, each time SIGKILLing one
worker (rank drawn at random) at a random point: a step drawn from the ones left, plus a random
delay, so that kills land in the forward/backward pass, in an async save, in a restore, or before
the first step. Each rerun resumes from `jshard.checkpoint.latest_step`. Checked after every kill and
resume:

- the launcher named the rank that was killed (and exited 137);
- the step resumed from is a verified one (its file record present) and no step whose save had
  returned (the worker printed `saved step K` after `SaveHandle.wait()`) was lost;
- every loss a resumed run prints equals the uninterrupted run's loss for that step, bit for bit.

`--write` stores the figures in `benchmarks/faults_results.json` and puts its section into
BENCHMARKS.md (`faults_section`, which `python -m benchmarks` also reads).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "_dist_worker.py"
RESULTS = Path(__file__).with_name("faults_results.json")
HEADING = "## Faults: a 2-process training run killed at random points"


def _launch(tmp: Path, name: str, steps: int, every: int, ckpt: Path) -> tuple[subprocess.Popen, Path, Path]:
    out, logs = tmp / f"out_{name}", tmp / f"logs_{name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSHARD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp / "jax_cache")
    command = [sys.executable, "-m", "jshard", "launch", "--worker-num", "2", "--devices-per-worker", "4",
               "--cluster-time-out", "60", "--hang-timeout", "300", "--log-dir", str(logs), str(WORKER), "train",
               str(out), "--steps", str(steps), "--ckpt", str(ckpt), "--ckpt-every", str(every)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    return proc, out, logs


def _losses(out: Path) -> dict[int, float]:
    try:
        return {int(k): v for k, v in json.loads((out / "rank0.json").read_text())["losses"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def _workers(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the launcher's workers (its children, in rank order)."""
    try:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    except OSError:
        return {}
    return dict(enumerate(sorted(map(int, children))))


def _saved(logs: Path) -> list[int]:
    text = (logs / "worker_0.log").read_text() if (logs / "worker_0.log").exists() else ""
    return [int(k) for k in re.findall(r"^saved step (\d+)$", text, re.M)]


def _one_kill(tmp: Path, k: int, rng: random.Random, args, ckpt: Path, start: int) -> dict:
    """One run from `start`, with one worker SIGKILLed at a random point; what it showed."""
    proc, out, logs = _launch(tmp, f"kill{k}", args.steps, args.every, ckpt)
    target = rng.randint(start, min(start + args.span, args.steps) - 1)  # kill once this step's loss is out
    # (start: before the first, in the restore or the compile)
    delay, rank = rng.uniform(0.0, args.max_delay), rng.randint(0, 1)
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None and time.monotonic() < deadline:
        logged = (logs / "worker_0.log").read_text() if (logs / "worker_0.log").exists() else ""
        if (max(_losses(out), default=start) >= target and target > start) or (target == start and "planned" in logged):
            break
        time.sleep(0.05)
    time.sleep(delay)
    pids = _workers(proc)
    killed = None
    if proc.poll() is None and rank in pids:
        os.kill(pids[rank], signal.SIGKILL)
        killed = rank
    _, err = proc.communicate(timeout=args.timeout)
    at = max(_losses(out), default=start)
    return {"killed": killed, "after_step": at, "target": target, "delay": round(delay, 3), "status": proc.returncode,
            "named": killed is not None and f"rank {killed} was killed by SIGKILL" in err, "saved": _saved(logs),
            "losses": _losses(out), "resumed": _resumed(logs)}


def _resumed(logs: Path) -> int | None:
    """The step a run said it resumed from (None: it said nothing, killed first or started afresh)."""
    text = (logs / "worker_0.log").read_text() if (logs / "worker_0.log").exists() else ""
    found = re.search(r"^resumed from step (\d+)$", text, re.M)
    return int(found.group(1)) if found else None


def run(args) -> dict:
    import jshard.checkpoint  # the verified steps, read as a user would (CPU only, no devices needed)
    from benchmarks._report import commit  # here: _report imports this module

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="jshard-faults-"))
    began = time.monotonic()
    proc, out, logs = _launch(tmp, "reference", args.steps, args.every, tmp / "ckpt_reference")
    proc.communicate(timeout=args.timeout)
    reference = _losses(out)
    assert proc.returncode == 0 and sorted(reference) == list(range(1, args.steps + 1)), (logs / "launcher.log").read_text()
    ckpt, rounds, confirmed = tmp / "ckpt", [], 0
    for k in range(args.kills + 1):
        start = jshard.checkpoint.latest_step(ckpt) or 0
        if k == args.kills:  # the last run goes to the end, uninterrupted
            proc, out, logs = _launch(tmp, "final", args.steps, args.every, ckpt)
            _, err = proc.communicate(timeout=args.timeout)
            r = {"killed": None, "status": proc.returncode, "saved": _saved(logs), "losses": _losses(out),
                 "resumed": _resumed(logs), "named": False, "after_step": args.steps}
        else:
            r = _one_kill(tmp, k, rng, args, ckpt, start)
        on_record = start == 0 or (ckpt / str(start) / "jshard_files.json").exists()
        r["start"], r["verified"] = start, on_record and r["resumed"] in (None, start)  # it resumed from that step
        r["lost"] = max(0, confirmed - start)  # steps up to a save that had returned, not resumed from
        r["wrong"] = [s for s, v in r["losses"].items() if v != reference[s]]
        confirmed = max([confirmed, *r["saved"]])
        rounds.append(r)
        print(f"run {k}: from step {start} ({'verified' if r['verified'] else 'UNVERIFIED'}), resumed {r['resumed']}, "
              f"killed rank {r['killed']} after step {r['after_step']} (+{r.get('delay', 0)} s), status {r['status']}, "
              f"named {r['named']}, saves returned {r['saved']}, lost {r['lost']}, wrong {r['wrong']}", flush=True)
    final = rounds[-1]
    kills = [r for r in rounds if r["killed"] is not None]
    return {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": f"python -m benchmarks._faults --kills {args.kills} --steps {args.steps} --every {args.every} "
                   f"--span {args.span} --seed {args.seed}" + (" --write" if args.write else ""),
        "commit": commit(), "minutes": round((time.monotonic() - began) / 60, 1), "steps": args.steps,
        "every": args.every, "kills": len(kills), "named": sum(r["named"] for r in kills),
        "resumes": len(rounds) - 1, "resumed_from": [r["start"] for r in rounds[1:]],
        "unverified": sum(not r["verified"] for r in rounds), "lost_steps": sum(r["lost"] for r in rounds),
        "wrong_values": sum(len(r["wrong"]) for r in rounds),
        "losses_checked": sum(len(r["losses"]) for r in rounds),
        "finished": final["status"] == 0 and sorted(final["losses"]) == list(range(final["start"] + 1, args.steps + 1)),
        "kill_points": [[r["killed"], r["after_step"], r["delay"]] for r in kills],
    }


def faults_section() -> str:
    """The BENCHMARKS.md section from `faults_results.json` ("" where the script has not run)."""
    if not RESULTS.exists():
        return ""
    f = json.loads(RESULTS.read_text())
    return "\n".join([
        HEADING, "",
        f"Not measured by `python -m benchmarks`: read from `benchmarks/faults_results.json`, written by `{f['command']}` "
        f"on {f['when']} in {f['minutes']} min, jshard commit {f['commit']}. The reference GPT (2-D preset) on 2 "
        f"processes x 4 simulated CPU devices under `jshard launch`, {f['steps']} steps, an async checkpoint every "
        f"{f['every']} steps; one worker (rank at random) SIGKILLed at a random point of each run, then the same "
        "command again, resuming from `jshard.checkpoint.latest_step`.", "",
        "| kills | launcher named the killed rank | resumes | resumed from an unverified step | lost steps "
        "| wrong values | losses compared | finished |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {f['kills']} | {f['named']} of {f['kills']} | {f['resumes']} | {f['unverified']} | {f['lost_steps']} "
        f"| {f['wrong_values']} | {f['losses_checked']} | {'yes' if f['finished'] else 'no'} |", "",
        f"- resumed from steps {f['resumed_from']}; kill points (rank, last step whose loss was out, extra delay s): "
        f"{f['kill_points']}",
        "- lost step: a step whose `SaveHandle.wait()` had returned before the kill but that the next run did not "
        "resume from (or after); wrong value: a loss of a resumed run that is not bit for bit the uninterrupted "
        "run's loss for that step.", ""])


def write_section(text: str, path: Path = REPO / "BENCHMARKS.md") -> None:
    """Puts `text` into BENCHMARKS.md in place of its section, or at the end."""
    doc = path.read_text()
    if HEADING in doc:
        head, rest = doc.split(HEADING, 1)
        tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
        doc = head + text + tail.lstrip("\n") if tail else head + text
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc.rstrip("\n") + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks._faults", description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--span", type=int, default=4, help="a kill comes within this many steps of the run's start")
    p.add_argument("--max-delay", type=float, default=1.5, help="seconds added at random to each kill point")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    p.add_argument("--write", action="store_true", help="store the figures and update BENCHMARKS.md")
    args = p.parse_args(argv)
    figures = run(args)
    print(json.dumps(figures, indent=1))
    if args.write:
        RESULTS.write_text(json.dumps(figures, indent=1) + "\n")
        write_section(faults_section())
    ok = figures["lost_steps"] == 0 and figures["wrong_values"] == 0 and figures["unverified"] == 0 and figures["finished"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
