"""The command line's commands (``trainfold ls``, ``verify``, ``inspect``, ``export``, ``diff``): what ``trainfold.cli``
runs once it has parsed its arguments, so that ``--help`` and a usage error import nothing of the library.

``ls``, ``verify`` and ``inspect`` read manifests and JSON files, verified: they import no torch (a second of CPU
and more), so they answer at once; ``export`` and ``diff`` read tensors and import it when they run.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
from pathlib import Path
from typing import Any, Iterator

from trainfold._src.base.history import history_from_rows
from trainfold._src.base.io import read_into
from trainfold._src.checkpoint.manifest import (
    DEEPSPEED,
    FORMAT,
    SHARDED,
    data_ranks,
    parse_json,
    read_manifest,
    read_manifest_json,
    read_verified,
)
from trainfold._src.checkpoint.root import latest_checkpoint, list_checkpoints, resolve, verify_checkpoint
from trainfold._src.checkpoint.storage import checkpoint_at, is_url, open_root
from trainfold.errors import CheckpointError

FORMAT_NAMES = {FORMAT: "gathered", SHARDED: "sharded", DEEPSPEED: "deepspeed"}


class Refused(Exception):
    """Bad input: one line on stderr, exit status 2."""


def _json_safe(value: Any) -> Any:
    """``value`` with each non-finite float as the string Python prints for it ("nan", "inf", "-inf"): JSON has no NaN,
    and a diverged run's records hold them (``json.dumps`` would write the bare ``NaN`` that JSON parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) (as SIGINT raises KeyboardInterrupt), so what a write made is removed on the way out."""

    def leave(signum: int, frame: Any) -> None:
        del frame  # unused
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, leave)
    except ValueError:  # not the main thread: leave the process's handlers alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def show(doc: Any, as_json: bool, text: Any) -> int:
    print(json.dumps(_json_safe(doc), indent=2, allow_nan=False) if as_json else text(doc))
    return 0


def _name(where: str) -> str:
    """The last part of a path or URL: a checkpoint's name."""
    return where.rstrip("/").rsplit("/", 1)[-1]


def _folder(where: str) -> str:
    """``where`` itself if it is a checkpoint, else the newest checkpoint of the root it names (a path, or a store's URL)."""
    if is_url(where):
        try:
            return str(resolve(where).path)
        except CheckpointError as exc:
            raise Refused(f"{exc} Give a checkpoint (ckpt-...) or the root that holds them.") from None
    path = Path(where)
    if (path / "MANIFEST.json").exists():
        return where
    if not path.is_dir():
        raise Refused(
            f"{path} does not exist or is not a folder: give a checkpoint folder (ckpt-...) or the root that holds them."
        )
    latest = latest_checkpoint(path)
    if latest is None:
        raise Refused(
            f"{path} is neither a trainfold checkpoint nor a root of them (no MANIFEST.json, no committed ckpt-* inside)."
        )
    return str(latest)


def _summary(folder: str, manifest: dict[str, Any]) -> dict[str, Any]:
    files = manifest.get("files", {})
    return {
        "name": _name(folder),
        "update": _count(manifest.get("step")),
        "epoch": _count(manifest.get("epoch")),
        "micro_step": _count(manifest.get("micro_step")),
        "format": FORMAT_NAMES.get(manifest.get("format", -1), f"unknown ({manifest.get('format')})"),
        "processes": _count(manifest.get("world_size")),
        "data_ranks": data_ranks(manifest),  # under tensor parallelism a group of processes is one share of the data
        "finite": manifest.get("finite", True),
        "bytes": sum(e.get("size", 0) for e in files.values() if isinstance(e, dict)),
    }


def _count(value: Any) -> int | None:
    """A manifest's counter as read: a non-negative int, or None for anything else (a damaged or forged manifest)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _shown(value: Any) -> str:
    return "?" if value is None else str(value)


def ls(root: str, verify: bool = False) -> dict[str, Any]:
    """The checkpoints under ``root``; with ``verify``, each one's files checked against its manifest (``ok``, ``error``)."""
    storage = open_root(root)
    if not storage.exists():
        reason = storage.unusable()  # a bucket that does not exist (a typo?) says so
        if reason is not None:
            raise Refused(f"{root}: {reason}.")
        raise Refused(
            f"{root} is not a folder (or, on a store, holds nothing): give the root that holds the checkpoints "
            "(what save_checkpoint was given)."
        )
    found = [str(c) for c in list_checkpoints(root)]  # every manifest read once to order them; the newest is the last
    latest = found[-1] if found else None
    entries = []
    for folder in found:
        entry = {
            **_summary(folder, read_manifest_json(checkpoint_at(folder))),
            "complete": True,
            "latest": folder == latest,
        }
        try:  # the position inside the epoch (state.json) and the epoch's length (rank-0.json), read as the manifest vouches
            state, first = _verified_json(folder, "state.json", "rank-0.json")
            entry["batch_in_epoch"] = state["state"].get("batch_in_epoch")
            length = first.get("epoch_length") if entry["batch_in_epoch"] else None
            entry["epoch_length"] = (
                length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
            )
        except (CheckpointError, KeyError, TypeError, AttributeError):
            entry["batch_in_epoch"] = entry["epoch_length"] = None
        if verify:
            try:
                verify_checkpoint(folder)
                entry["ok"], entry["error"] = True, None
            except CheckpointError as exc:
                entry["ok"], entry["error"] = False, str(exc)
        entries.append(entry)
    for debris in storage.unfinished():
        entries.append({"name": debris, "complete": False, "latest": False})
    return {"root": str(root), "checkpoints": entries}


def ls_text(doc: dict[str, Any]) -> str:
    lines = [f"{doc['root']}:"]
    for e in doc["checkpoints"]:
        if not e["complete"]:
            lines.append(
                f"    {e['name']:<28} debris of an unfinished save (removed by the next save; on a store, by the next job to take the root)"
            )
            continue
        where = f"after epoch {_shown(e['epoch'])}"
        if e.get(
            "batch_in_epoch"
        ):  # of how many: a save at an epoch's last batch reads "batch 44/44", not as if half-way
            epoch = "?" if e["epoch"] is None else e["epoch"] + 1
            where = f"epoch {epoch} batch {e['batch_in_epoch']}" + (
                f"/{e['epoch_length']}" if e.get("epoch_length") else ""
            )
        checked = "" if "ok" not in e else "  verified" if e["ok"] else f"  DAMAGED: {e['error']}"
        lines.append(
            f"{'  *' if e['latest'] else '   '} {e['name']:<28} update {_shown(e['update']):<8} {where:<22} {e['format']:<9} "
            f"{_shown(e['processes'])} process(es)  {'finite' if e['finite'] is not False else 'NON-FINITE'}  {size_text(e['bytes'])}{checked}"
        )
    complete = [e for e in doc["checkpoints"] if e["complete"]]
    if len(lines) == 1:
        lines.append("    (no checkpoints)")
    elif any(e.get("latest") for e in complete):
        sound = [e for e in complete if e.get("ok", True)]
        if "ok" not in complete[-1]:  # not read: a damaged newest would be passed over by a load
            lines.append(
                "* the newest: load_checkpoint(ctx, root, state) resumes from it if it verifies, else from the newest "
                "that does (trainfold ls --verify checks each)"
            )
        elif complete[-1]["ok"]:
            lines.append("* the newest, what load_checkpoint(ctx, root, state) resumes from")
        else:
            instead = (
                f"from {sound[-1]['name']}, the newest that verifies"
                if sound
                else "from none: every checkpoint is damaged"
            )
            lines.append(f"* the newest, damaged: load_checkpoint(ctx, root, state) resumes {instead}")
    return "\n".join(lines)


def size_text(n: int) -> str:
    size = float(n)  # sync: none: a host int
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def verify(path: str, as_json: bool) -> int:
    folder = _folder(path)
    try:
        manifest = verify_checkpoint(folder)
    except CheckpointError as exc:
        print(
            json.dumps({"checkpoint": str(folder), "ok": False, "error": str(exc)})
            if as_json
            else f"{folder}: FAILED: {exc}"
        )
        return 1
    files = manifest["files"]
    print(
        json.dumps({"checkpoint": str(folder), "ok": True, "files": len(files)})
        if as_json
        else f"{folder}: OK ({len(files)} files, {size_text(sum(e['size'] for e in files.values()))}, every one of the size and digest its manifest records)"
    )
    return 0


def _verified_json(folder: str, *names: str) -> list[Any]:
    """The JSON files ``names`` of a checkpoint, read (the manifest once) after their sizes and digests are checked
    against it: JSON only, nothing runs."""
    stored = checkpoint_at(folder)
    files = read_verified(stored, read_manifest(stored), list(names))
    return [parse_json(folder, name, files[name]) for name in names]


def _state(folder: str) -> dict[str, Any]:
    """``state.json``, verified (:func:`_verified_json`), and checked to be a run state."""
    (doc,) = _verified_json(folder, "state.json")
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict):
        raise CheckpointError(f"{folder}: state.json is not a trainfold run state.")
    return doc


def inspect(path: str) -> dict[str, Any]:
    folder = _folder(path)
    try:
        manifest = read_manifest_json(checkpoint_at(folder))
        doc = _state(folder)
    except CheckpointError as exc:
        raise Refused(f"{exc} (trainfold verify {folder} checks every file)") from None
    state, acc = doc["state"], doc.get("accelerate", {})
    try:  # the records as a load checks them
        history = history_from_rows(state.get("history", []))
    except ValueError as exc:
        raise Refused(f"{folder}/state.json is damaged: {exc} (trainfold verify {folder} checks every file)") from None
    return {
        **_summary(folder, manifest),
        "checkpoint": str(folder),
        "batch_in_epoch": state.get("batch_in_epoch"),
        "stop": _stop(state),
        "last_records": [
            {"epoch": r.epoch, "update": r.step, "name": r.name, "value": r.value} for r in tuple(history)[-8:]
        ],
        "last_report": _last_report(state),
        "throughput": _throughput(history),
        "stragglers": _stragglers(history),
        "gradient_accumulation_steps": acc.get("gradient_accumulation_steps"),
        "mixed_precision": acc.get("mixed_precision"),
        "layout": doc.get("layout", {}),
        "parameters": doc.get("parameters", {}),
        "frozen": _frozen(folder, doc.get("frozen")),
        "run_id": manifest.get("run_id"),
        "trainfold_version": manifest.get("trainfold_version"),
        "torch_version": manifest.get("torch_version"),
    }


def _frozen(folder: str, entries: Any) -> dict[str, Any] | None:
    """What an adapter checkpoint records of its base instead of holding it: how many frozen tensors and values, and one
    digest of their fingerprints (two checkpoints of the same base show the same), or None for a checkpoint that holds every parameter."""
    from trainfold._src.checkpoint import digest

    if not entries:
        return None
    try:
        values = sum(math.prod(e["shape"]) for e in entries)
    except (TypeError, KeyError) as exc:
        raise Refused(
            f"{folder}/state.json is damaged: its frozen entries are not fingerprints ({exc}) (trainfold verify {folder} checks every file)"
        ) from None
    return {"tensors": len(entries), "values": values, "base": digest.of(json.dumps(entries, sort_keys=True).encode())}


def _last_report(state: dict[str, Any]) -> dict[str, Any] | None:
    """``log_every``'s last report as the checkpoint holds it (``state.extras["log_every"]``): its update and values (a
    watched run's rates, MFU, time shares and memory among them), or None where there is none or it is not one."""
    extras = state.get("extras")
    pairs = extras.get("__dict__") if isinstance(extras, dict) else None
    record = (
        next((v for k, v in pairs if k == "log_every"), None)
        if isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 for p in pairs)
        else None
    )
    fields = record.get("fields") if isinstance(record, dict) and record.get("__record__") == "LogState" else None
    if not isinstance(fields, dict) or not isinstance(fields.get("values"), dict):
        return None
    values = fields["values"].get("__dict__")
    if not isinstance(values, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in values
    ):
        return None
    return {"update": fields.get("step"), "values": {k: v for k, v in values if isinstance(v, (int, float))}}


#: A watched run's epoch figures (``run_epoch``'s records when ``log_every(watch=...)`` is on), as ``inspect`` lists them.
EPOCH_FIGURES = (
    "epoch_s",
    "samples_per_s",
    "tokens_per_s",
    "memory_allocated_gb",
    "memory_reserved_gb",
    "memory_rss_gb",
)


def _throughput(history: Any) -> list[dict[str, Any]]:
    """Each watched epoch's figures, in order: ``{"epoch", "update", "epoch_s", "samples_per_s"[, "tokens_per_s"][, memory]}``."""
    rows: dict[int, dict[str, Any]] = {}
    for r in history:
        if r.name.startswith("train_") and r.name[len("train_") :] in EPOCH_FIGURES:
            rows.setdefault(r.epoch, {"epoch": r.epoch, "update": r.step})[r.name[len("train_") :]] = r.value
    return [rows[e] for e in sorted(rows)]


def _stragglers(history: Any) -> list[dict[str, Any]]:
    """Each epoch's straggler counts, where the watch named stragglers (several processes): ``{"epoch", "update",
    "input", "compute"[, "input_process"][, "compute_process"]}`` (the reports that named one, the process named most)."""
    rows: dict[int, dict[str, Any]] = {}
    for r in history:
        for kind in ("input", "compute"):
            if r.name in (f"train_stragglers_{kind}", f"train_straggler_{kind}_process"):
                key = kind if r.name.startswith("train_stragglers_") else f"{kind}_process"
                rows.setdefault(r.epoch, {"epoch": r.epoch, "update": r.step})[key] = r.value
    return [rows[e] for e in sorted(rows)]


def _straggler_text(row: dict[str, Any]) -> str:
    """One epoch's counts as ``inspect`` prints them: ``input 1 (process 1), compute 0``."""
    return ", ".join(
        f"{kind} {int(row.get(kind, 0))}"
        + (f" (process {int(row[f'{kind}_process'])})" if f"{kind}_process" in row else "")
        for kind in ("input", "compute")
    )


#: What ``inspect`` prints of a watched run's last report, in this order (a share of time as a percentage).
REPORTED = (
    "samples_per_s",
    "tokens_per_s",
    "updates_per_s",
    "mfu",
    "time_data",
    "time_step",
    "time_update",
    "time_checkpoint",
    "time_stop",
    "memory_allocated_gb",
    "memory_reserved_gb",
    "memory_rss_gb",
)


def _epoch_figure(name: str, value: float) -> str:
    """One of :data:`EPOCH_FIGURES` as ``inspect`` prints it: ``12.5 s``, ``300 samples/s``, ``1.2 GB rss``."""
    if name.endswith("_per_s"):
        return f"{value:.4g} {name.removesuffix('_per_s')}/s"
    if name.startswith("memory_"):
        return f"{value:.3g} GB {name.removeprefix('memory_').removesuffix('_gb')}"
    return f"{value:.4g} s"


def _stop(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's stop as ``state.json`` holds it: a ``Stop`` record (or null); older checkpoints' separate fields."""
    if "stop" not in state:
        return {
            "should_stop": state.get("should_stop", False),
            "finished": state.get("finished", False),
            "reason": state.get("stop_reason", ""),
        }
    stop = state["stop"]
    fields = stop.get("fields", {}) if isinstance(stop, dict) else {}
    return {
        "should_stop": stop is not None,
        "finished": fields.get("finished", False),
        "reason": fields.get("reason", ""),
    }


def inspect_text(d: dict[str, Any]) -> str:
    stop = d["stop"]
    lines = [
        f"{d['checkpoint']}",
        f"  update {_shown(d['update'])}, epoch {_shown(d['epoch'])} done, batch {d['batch_in_epoch']} of the next, micro-batch {_shown(d['micro_step'])}",
        f"  stop: {'finished' if stop['finished'] else 'stopped' if stop['should_stop'] else 'none (a run resumed from it goes on)'}"
        + (f" ({stop['reason']})" if stop["reason"] else ""),
        f"  {d['format']} format, {d['processes']} process(es){_ranks(d)}, {'finite' if d['finite'] is not False else 'NON-FINITE'} weights, {size_text(d['bytes'])}",
        f"  gradient_accumulation_steps {d['gradient_accumulation_steps']}, mixed_precision {d['mixed_precision']}, layout {d['layout']}",
        f"  run {d['run_id']}, written by trainfold {d['trainfold_version']} with torch {d['torch_version']}",
    ]
    if d["parameters"]:
        counts = d["parameters"]
        lines.append(f"  parameters: {counts.get('trainable', 0):,} trainable, {counts.get('frozen', 0):,} frozen")
    if d["frozen"]:
        f = d["frozen"]
        counts = d["parameters"] or {}
        tied = (
            "frozen" in counts and counts["frozen"] != f["values"]
        )  # the parameters count a tensor once, fingerprints per name
        values = f"{f['values']:,} values" + (
            ", one fingerprint per name: a weight tied under several names counts under each" if tied else ""
        )
        lines.append(
            f"  adapter checkpoint: {f['tensors']} frozen tensor(s) ({values}) not held, recorded by fingerprint; "
            f"base {f['base']} (a load checks the model's base against it)"
        )
    if d["last_records"]:
        lines.append(
            "  last records: "
            + ", ".join(
                f"{r['name']} {r['value']:.6g} (epoch {r['epoch']}, update {r['update']})" for r in d["last_records"]
            )
        )
    if d.get("throughput"):
        lines.append(
            "  throughput by epoch: "
            + "; ".join(
                f"{t['epoch']}: " + ", ".join(_epoch_figure(k, t[k]) for k in EPOCH_FIGURES if k in t)
                for t in d["throughput"][-8:]
            )
        )
    if d.get("stragglers"):
        lines.append(
            "  stragglers by epoch: "
            + "; ".join(f"{row['epoch']}: {_straggler_text(row)}" for row in d["stragglers"][-8:])
        )
    report = d.get("last_report")
    shown = [k for k in REPORTED if k in report["values"]] if report is not None else []
    if report is not None and shown:
        values = report["values"]
        lines.append(
            f"  last report (update {report['update']}): "
            + ", ".join(f"{k} {values[k]:.1%}" if k.startswith("time_") else f"{k} {values[k]:.4g}" for k in shown)
        )
    return "\n".join(lines)


def _ranks(d: dict[str, Any]) -> str:
    """ ", in N data-parallel ranks" where that is not one per process (tensor parallelism)."""
    return "" if d["data_ranks"] == d["processes"] else f" in {d['data_ranks']} data-parallel rank(s)"


def export(path: str, out: Path, transformers_config: str | None, base: str | None = None) -> dict[str, Any]:
    from trainfold._src.checkpoint import safetensors as _safetensors
    from trainfold._src.checkpoint.export import export_checkpoint

    folder = _folder(path)
    if transformers_config is not None and not Path(transformers_config).is_dir():
        raise Refused(
            f"--transformers {transformers_config} is not a folder: name a Hugging Face model folder (its config.json at least)."
        )
    try:
        adapters = base is None and bool(_state(folder).get("frozen"))  # sync: none: a JSON value
        written = export_checkpoint(folder, out, transformers_config=transformers_config, base=base)
    except (FileExistsError, ImportError) as exc:
        raise Refused(str(exc)) from None
    except CheckpointError as exc:
        raise Refused(f"{exc} (trainfold verify {folder} checks every file)") from None
    files = sorted(written.glob("*.safetensors")) if written.is_dir() else [written]
    tensors = sum(len(_safetensors.index(read_into(f, f.stat().st_size))) for f in files)
    size = sum(f.stat().st_size for f in (written.iterdir() if written.is_dir() else [written]))
    what = ("peft adapters" if (written / "adapter_config.json").exists() else "adapters") if adapters else "model"
    return {"checkpoint": str(folder), "out": str(written), "tensors": tensors, "bytes": size, "what": what}


def export_text(d: dict[str, Any]) -> str:
    text = f"wrote {d['out']}: {d['tensors']} tensors, {size_text(d['bytes'])}"
    if d["what"] == "model":
        return text
    return (
        f"{text}: the adapters alone{' (PeftModel.from_pretrained(base_model, OUT) loads them)' if d['what'] == 'peft adapters' else ''}. "
        "The checkpoint records its base by fingerprint; --base BASE writes the whole model."
    )


def _weights(where: str) -> dict[str, Any]:
    """A safetensors file's tensors, or a checkpoint's (a folder or a root, local or on a store) model weights."""
    from trainfold._src.checkpoint import safetensors as _safetensors
    from trainfold._src.checkpoint.export import checkpoint_weights

    path = Path(where)
    try:
        if not is_url(where) and path.is_file():
            return dict(_safetensors.parse(read_into(path, path.stat().st_size)))
        return checkpoint_weights(_folder(where))
    except _safetensors.FormatError as exc:
        raise Refused(f"{path} is not a safetensors file ({exc}).") from None
    except CheckpointError as exc:
        raise Refused(str(exc)) from None


def diff(a: str, b: str) -> dict[str, Any]:
    import torch

    left, right = _weights(a), _weights(b)
    rows: list[dict[str, Any]] = []
    for name in sorted(left.keys() & right.keys()):
        x, y = left[name], right[name]
        if tuple(x.shape) != tuple(y.shape):
            rows.append({"name": name, "shapes": [list(x.shape), list(y.shape)], "max_abs_diff": None})
        elif not torch.equal(x, y):
            diff = float((x.double() - y.double()).abs().max())  # sync: none, CPU tensors
            rows.append({"name": name, "max_abs_diff": diff})
    only = {"a": sorted(left.keys() - right.keys()), "b": sorted(right.keys() - left.keys())}
    return {
        "a": str(a),
        "b": str(b),
        "compared": len(left.keys() & right.keys()),
        "different": rows,
        "only_in": only,
        "equal": not rows and not only["a"] and not only["b"],
    }


def diff_text(d: dict[str, Any]) -> str:
    if d["equal"]:
        return f"equal: {d['compared']} tensors, bit for bit"
    if not d["compared"]:
        return (
            f"no tensor in common: {d['a']} has {', '.join(d['only_in']['a']) or 'none'}; "
            f"{d['b']} has {', '.join(d['only_in']['b']) or 'none'}"
        )
    lines = [f"{len(d['different'])} of {d['compared']} tensors differ:"]
    for r in d["different"]:
        lines.append(
            f"  {r['name']}: "
            + (
                f"shape {r['shapes'][0]} vs {r['shapes'][1]}"
                if r["max_abs_diff"] is None
                else f"max |a - b| {r['max_abs_diff']:.6g}"
            )
        )
    for side in ("a", "b"):
        if d["only_in"][side]:
            lines.append(f"  only in {side}: {', '.join(d['only_in'][side])}")
    return "\n".join(lines)
