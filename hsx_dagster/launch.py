"""Run shards through the job `hidden_states_shard` from a shell, exactly as the UI launches them, and wait.

    python -m hsx_dagster.launch shard-00 shard-01 [--config-json '{"resources": {...}}']

`dagster job execute` runs a job in the calling process without its code location, so the UI
cannot tell which location a run belongs to and the job's Runs tab stays empty; `dagster job
launch` only queues the run for the daemon. This command creates each run with its code location
(`hsx_dagster.definitions`), hands it to the instance's run launcher (the same subprocess a UI
launch gets, bypassing the queue, which needs the daemon), and waits for it: the runs show on the
job's page and on each partition, with their blocking shard checks. Shards run one after another;
the exit status is non-zero when any run failed or any shard's blocking check failed. Dagster has
no public API for such a launch: it goes through `hsx_dagster.dagster_internals`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from dagster import AssetCheckEvaluation, DagsterEventType, DagsterInstance, DagsterRunStatus

from hsx_dagster.asset_keys import HIDDEN_STATES
from hsx_dagster.dagster_internals import code_location_job

JOB = "hidden_states_shard"
MODULE = "hsx_dagster.definitions"


def launch_shards(
    instance: DagsterInstance,
    shards: Sequence[str],
    run_config: dict | None = None,
    poll_s: float = 1.0,
    say=print,
) -> dict[str, DagsterRunStatus]:
    """One run of `hidden_states_shard` per shard, one after another; the final status of each."""
    results: dict[str, DagsterRunStatus] = {}
    with code_location_job(instance, MODULE, JOB) as job:
        for shard in shards:
            run_id = job.launch(run_config or {}, tags={"dagster/partition": shard})
            say(f"{shard}: run {run_id} of {JOB}")
            while (current := instance.get_run_by_id(run_id)) is not None and not current.is_finished:
                time.sleep(poll_s)
            status = current.status if current else DagsterRunStatus.FAILURE
            results[shard] = status
            failed_checks = _failed_checks(instance, run_id)
            say(
                f"{shard}: {status.value.lower()}"
                + (f"; blocking checks failed: {', '.join(failed_checks)}" if failed_checks else "")
            )
            if failed_checks and status == DagsterRunStatus.SUCCESS:
                results[shard] = DagsterRunStatus.FAILURE
    return results


def _failed_checks(instance: DagsterInstance, run_id: str) -> list[str]:
    """Names of the blocking shard checks that failed in the run."""
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records
    data = [r.event_log_entry.dagster_event.event_specific_data for r in records if r.event_log_entry.dagster_event]
    evaluations = [e for e in data if isinstance(e, AssetCheckEvaluation)]
    return sorted(e.check_name for e in evaluations if e.asset_key == HIDDEN_STATES and not e.passed)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsx_dagster.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("shards", nargs="+", help="partition keys, e.g. shard-00 shard-01")
    parser.add_argument("--config-json", help="run config, as for `dagster asset materialize --config-json`")
    args = parser.parse_args(argv)
    with DagsterInstance.get() as instance:
        results = launch_shards(instance, args.shards, json.loads(args.config_json) if args.config_json else None)
    failed = [shard for shard, status in results.items() if status != DagsterRunStatus.SUCCESS]
    if failed:
        print(f"failed: {', '.join(failed)} (see the runs in the UI: make ui)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
