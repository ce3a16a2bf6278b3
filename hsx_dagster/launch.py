"""Run shards through the job `hidden_states_shard` from a shell, exactly as the UI launches them, and wait.

    python -m hsx_dagster.launch shard-00 shard-01 [--together] [--config-json '{"resources": {...}}']

`dagster job execute` runs a job in the calling process without its code location, so the UI
cannot tell which location a run belongs to and the job's Runs tab stays empty; `dagster job
launch` only queues the run for the daemon. This command creates each run with its code location
(`hsx_dagster.definitions`), hands it to the instance's run launcher (the same subprocess a UI
launch gets, bypassing the queue, which needs the daemon), and waits for it: the runs show on the
job's page and on each partition, with their blocking shard checks. Shards run one after another, or with
`--together` all at once (on a cluster, where the run launcher places each run on a GPU of its own); the
exit status is non-zero when any run failed or any shard's blocking check failed. Dagster has
no public API for such a launch: it goes through `hsx_dagster.defs_support.dagster_internals`.

On an instance whose runs become Ray jobs (deploy/ray/), nothing is launched unless this process holds the cluster's
token and the cluster refuses requests without it (`hsx_dagster.defs_support.ray_access`; docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from dagster import AssetCheckEvaluation, DagsterEventType, DagsterInstance, DagsterRunStatus

from hsx_dagster.defs_support.asset_keys import HIDDEN_STATES
from hsx_dagster.defs_support.dagster_internals import code_location_job
from hsx_dagster.defs_support.ray_access import ray_access_problem

JOB = "hidden_states_shard"
MODULE = "hsx_dagster.definitions"


def launch_shards(
    instance: DagsterInstance,
    shards: Sequence[str],
    run_config: dict | None = None,
    poll_s: float = 1.0,
    say=print,
    together: bool = False,
) -> dict[str, DagsterRunStatus]:
    """One run of `hidden_states_shard` per shard, one after another (``together``: all launched, then waited
    for); the final status of each."""
    results: dict[str, DagsterRunStatus] = {}
    with code_location_job(instance, MODULE, JOB) as job:
        batches = [list(shards)] if together else [[shard] for shard in shards]
        for batch in batches:
            run_ids = {}
            for shard in batch:
                run_ids[shard] = job.launch(run_config or {}, tags={"dagster/partition": shard})
                say(f"{shard}: run {run_ids[shard]} of {JOB}")
            for shard, run_id in run_ids.items():
                results[shard] = _wait_for(instance, shard, run_id, poll_s, say)
    return results


def _wait_for(instance: DagsterInstance, shard: str, run_id: str, poll_s: float, say) -> DagsterRunStatus:
    """The run's final status; a success whose blocking checks failed counts as a failure."""
    while (current := instance.get_run_by_id(run_id)) is not None and not current.is_finished:
        time.sleep(poll_s)
    status = current.status if current else DagsterRunStatus.FAILURE
    failed_checks = _failed_checks(instance, run_id)
    say(
        f"{shard}: {status.value.lower()}"
        + (f"; blocking checks failed: {', '.join(failed_checks)}" if failed_checks else "")
    )
    return DagsterRunStatus.FAILURE if failed_checks and status == DagsterRunStatus.SUCCESS else status


def _failed_checks(instance: DagsterInstance, run_id: str) -> list[str]:
    """Names of the blocking shard checks that failed in the run."""
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records
    data = [r.event_log_entry.dagster_event.event_specific_data for r in records if r.event_log_entry.dagster_event]
    evaluations = [e for e in data if isinstance(e, AssetCheckEvaluation)]
    return sorted(e.check_name for e in evaluations if e.asset_key == HIDDEN_STATES and not e.passed)


def launch_problem(instance: DagsterInstance) -> str | None:
    """Why no run may be launched on this instance now (its runs are Ray jobs and the cluster's token is missing,
    wrong or not asked for), or None."""
    launcher = instance.run_launcher
    if type(launcher).__module__.split(".")[0] != "dagster_ray":
        return None
    return ray_access_problem(getattr(launcher, "address", None) or "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsx_dagster.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("shards", nargs="+", help="partition keys, e.g. shard-00 shard-01")
    parser.add_argument("--config-json", help="run config, as for `dagster asset materialize --config-json`")
    parser.add_argument(
        "--together",
        action="store_true",
        help="launch every run at once, then wait for all (a cluster's run launcher gives each its own GPU)",
    )
    args = parser.parse_args(argv)
    run_config = json.loads(args.config_json) if args.config_json else None
    with DagsterInstance.get() as instance:
        if problem := launch_problem(instance):
            print(f"nothing launched: {problem}", file=sys.stderr)
            return 2
        results = launch_shards(instance, args.shards, run_config, together=args.together)
    failed = [shard for shard, status in results.items() if status != DagsterRunStatus.SUCCESS]
    if failed:
        print(f"failed: {', '.join(failed)} (see the runs in the UI: make ui)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
