"""MLflow: runs are tagged with the trainfold run's id; a resumed run goes on with the run so tagged and is sent only
what it lacks (MLflow cannot delete what it holds)."""

from __future__ import annotations

import json
import os
from typing import Any

from trainfold._src.backend.trackers.protocol import GoingOn, Vendor, warn_no_run


#: The tag with which ``init_trackers`` marks an MLflow run as this trainfold run's (``TrainState.run_id``).
RUN_TAG = "trainfold.run_id"


def _run_of(project_name: str, run_id: str) -> str | None:
    """The id of the newest MLflow run in experiment ``project_name`` tagged with trainfold's ``run_id``, or None."""
    import mlflow

    runs = mlflow.search_runs(
        experiment_names=[project_name],
        filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
        output_format="list",
    )
    return runs[0].info.run_id if runs else None


def holds(tracker: Any, at: int) -> dict[str, int]:
    """Each metric of the MLflow run ``tracker`` goes on with, and the last step it holds, where that is ``at`` (the
    update the resumed run goes on from: an epoch's record logged after its checkpoint) or later."""
    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(), tracker.active_run.info.run_id
    last = {
        key: max(m.step for m in client.get_metric_history(run_id, key)) for key in client.get_run(run_id).data.metrics
    }
    return {key: step for key, step in last.items() if step >= at}


def prepare(run: GoingOn, mine: dict[str, Any]) -> bool:
    """Tag the MLflow run with the trainfold run's id; a resumed run goes on with the MLflow run so tagged."""
    if isinstance(mine.get("tags"), str):
        mine["tags"] = json.loads(mine["tags"])  # as Accelerate's MLflowTracker reads a string
    mine["tags"] = {**(mine.get("tags") or {}), RUN_TAG: run.run_id}
    if run.step > 0 and run.main and not mine.get("run_id") and not os.environ.get("MLFLOW_RUN_ID"):
        found = _run_of(run.project, run.run_id)
        if found is None:
            warn_no_run(
                "MLflow", f"experiment {run.project!r} tagged {RUN_TAG}={run.run_id}", run, "MLFLOW_TRACKING_URI"
            )
        else:
            mine["run_id"] = found
    return True


VENDOR = Vendor(prepare=prepare, holds=holds)
