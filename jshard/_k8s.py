"""`jshard k8s`: a Kubernetes manifest that runs a job's workers as an indexed Job.

The manifest holds a headless Service (stable DNS names for the pods) and an indexed Job of
`--worker-num` completions run in parallel. Pod `i` is process `i`: its `JSHARD_PROCESS_ID` comes
from the Job's completion index, and every pod reaches process 0's coordination service at
`<name>-0.<name>:<port>`, the environment `jshard.init()` reads; `JSHARD_HANG_TIMEOUT` turns on its
hang watchdog (`--hang-timeout`, 600 s as under `jshard launch`: a pod whose main thread makes no
progress that long names the rank that did not arrive and exits 124, failing the Job rather than
holding its nodes). The manifest is printed as YAML
written from plain dicts, so no YAML library is needed to make it and any YAML reader can load it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from jshard._worker import DEFAULT_HANG_TIMEOUT, HANG_TIMEOUT

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def k8s_parser(sub) -> None:
    """Adds the `k8s` subcommand to the `jshard` command line's subparsers."""
    p = sub.add_parser("k8s", help="print a Kubernetes manifest (indexed Job + headless Service) for a job",
                       description="Prints a Kubernetes manifest that runs COMMAND in --worker-num pods wired "
                       "for jshard.init(): apply it with `kubectl apply -f -`.")
    p.add_argument("--worker-num", type=int, required=True, help="processes (pods) in the job")
    p.add_argument("--image", required=True, help="container image holding the code and jshard")
    p.add_argument("--name", default="jshard", help="Job and Service name (default jshard)")
    p.add_argument("--port", type=int, default=8118, help="coordinator port (default 8118)")
    p.add_argument("--gpus-per-worker", type=int, default=0, help="nvidia.com/gpu per pod (default 0)")
    p.add_argument("--namespace", default=None, help="namespace (default: kubectl's current one)")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT,
                   help="seconds a pod may make no progress before it ends the job (default 600; 0: never)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="-- program [args]")


def run_k8s(args: argparse.Namespace) -> int:
    """The `k8s` subcommand: prints the manifest, or an error and status 2."""
    command = args.argv[1:] if args.argv[:1] == ["--"] else list(args.argv)
    try:
        docs = manifest(args.worker_num, args.image, command, name=args.name, port=args.port,
                        gpus_per_worker=args.gpus_per_worker, namespace=args.namespace,
                        hang_timeout=args.hang_timeout)
    except ValueError as e:
        print(f"jshard k8s: error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(docs), end="")
    return 0


def manifest(worker_num: int, image: str, command: list[str], *, name: str = "jshard", port: int = 8118,
             gpus_per_worker: int = 0, namespace: str | None = None,
             hang_timeout: float = DEFAULT_HANG_TIMEOUT) -> list[dict]:
    """The Service and the indexed Job, as the dicts `kubectl` reads.

    Examples:
      >>> service, job = manifest(2, "me/train:1", ["python", "train.py"])
      >>> job["spec"]["completionMode"], job["spec"]["parallelism"]
      ('Indexed', 2)
    """
    if worker_num < 1:
        raise ValueError(f"--worker-num must be positive, got {worker_num}.")
    if not command:
        raise ValueError("no COMMAND: give it after `--`, e.g. -- python train.py.")
    if hang_timeout < 0:
        raise ValueError(f"--hang-timeout must be 0 (no watchdog) or positive, got {hang_timeout:g}.")
    if not _NAME.match(name) or len(name) > 50:
        raise ValueError(f"--name {name!r} must be a DNS label: lowercase letters, digits and '-', at most 50.")
    meta = {"name": name, "labels": {"app": name}} | ({"namespace": namespace} if namespace else {})
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"clusterIP": "None", "selector": {"job-name": name},
                 "ports": [{"name": "coordinator", "port": port, "targetPort": port}]},
    }
    env = [
        {"name": "JSHARD_COORDINATOR", "value": f"{name}-0.{name}:{port}"},
        {"name": "JSHARD_NUM_PROCESSES", "value": str(worker_num)},
        {"name": "JSHARD_PROCESS_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
    ] + ([{"name": HANG_TIMEOUT, "value": f"{hang_timeout:g}"}] if hang_timeout > 0 else [])
    container = {"name": "worker", "image": image, "command": list(command), "env": env,
                 "ports": [{"containerPort": port, "name": "coordinator"}]}
    if gpus_per_worker:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_worker}}
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
        "spec": {
            "completionMode": "Indexed", "completions": worker_num, "parallelism": worker_num,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": {"app": name}},
                         "spec": {"subdomain": name, "restartPolicy": "Never", "containers": [container]}},
        },
    }
    return [service, job]


def to_yaml(docs: list[dict]) -> str:
    """YAML documents for `docs`: block mappings and lists, every string JSON-quoted (valid YAML).

    Examples:
      >>> print(to_yaml([{"a": [1, {"b": "x"}]}]), end="")
      a:
        - 1
        - b: "x"
    """
    return "---\n".join("\n".join(_lines(doc, 0)) + "\n" for doc in docs)


def _lines(value, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{k}:")
                out += _lines(v, indent + 2)
            else:
                out.append(f"{pad}{k}: {_scalar(v)}")
        return out
    out = []
    for v in value:
        inner = _lines(v, indent + 2) if isinstance(v, (dict, list)) and v else [f"{pad}  {_scalar(v)}"]
        out.append(f"{pad}- {inner[0].lstrip()}")
        out += inner[1:]
    return out


def _scalar(v) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, (dict, list)):
        return "{}" if isinstance(v, dict) else "[]"
    return json.dumps(str(v))
