"""``python -m trainfold`` (and the ``trainfold`` command): what people do with checkpoints outside training.

    trainfold ls ROOT          each checkpoint under ROOT: update, epoch, position, format, processes, finite, size
                               (--verify: each one's files checked too, a damaged one marked; exit 1 if any is)
    trainfold verify PATH      the manifest check of a checkpoint (exit 1 when it fails, naming the file and why)
    trainfold inspect PATH     counters, stop, the last records, accumulation and precision, layout, versions
    trainfold export PATH OUT  the model's weights as one safetensors file (gathered, sharded of any mesh, DeepSpeed ZeRO);
                               with --transformers CONFIG_DIR, a save_pretrained folder of CONFIG_DIR's model; of an
                               adapter checkpoint the adapters alone (a PEFT model's as a folder PEFT loads), or with
                               --base BASE (its safetensors file or save_pretrained folder, checked) the whole model
    trainfold diff A B         per-tensor max |difference| of two checkpoints or weight files (exit 0 when bit-equal)

``--json`` prints one JSON document instead, for scripts. ROOT, PATH, A and B may be
URLs of a store (``s3://bucket/run``, ``az://container/run``), configured as fsspec
configures it (``FSSPEC_S3_ENDPOINT_URL``, the provider's credentials). A path that is
not a checkpoint (or, for ``inspect``, a damaged one), or a store that cannot be read,
is one line on stderr and exit status 2; nothing here loads a model or needs a process
group, and nothing is unpickled: the manifest and ``state.json`` are read as JSON,
verified first.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return its exit status (0 done, 1 a checkpoint failed verification, 2 bad input)."""
    parser = argparse.ArgumentParser(
        prog="trainfold", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, what, places in (
        ("ls", "list the checkpoints under a root", ("root",)),
        ("verify", "check a checkpoint against its manifest", ("path",)),
        ("inspect", "what a checkpoint holds, besides its tensors", ("path",)),
        ("export", "the model's weights as one safetensors file (or a save_pretrained folder)", ("path", "out")),
        ("diff", "compare the weights of two checkpoints or safetensors files", ("a", "b")),
    ):
        sub = subparsers.add_parser(name, help=what)
        for place in places:
            sub.add_argument(place)
        sub.add_argument("--json", action="store_true", help="one JSON document, for scripts")
        if name == "ls":
            sub.add_argument(
                "--verify",
                action="store_true",
                help="check every checkpoint's files against its manifest, marking a damaged one (exit 1 if any is)",
            )
        if name == "export":
            sub.add_argument(
                "--transformers",
                metavar="CONFIG_DIR",
                help="write OUT as a save_pretrained folder of this Hugging Face model folder's model",
            )
            sub.add_argument(
                "--base",
                metavar="BASE",
                help="an adapter checkpoint's base (a safetensors file or save_pretrained folder): "
                "checked against the checkpoint's fingerprint, OUT gets the whole model (LoRA merged)",
            )
    args = parser.parse_args(argv)
    from trainfold._src import commands  # the library, imported once the arguments are good

    try:
        if args.command == "ls":
            listed = commands.ls(args.root, args.verify)
            commands.show(listed, args.json, commands.ls_text)
            return 1 if any(e.get("ok") is False for e in listed["checkpoints"]) else 0
        if args.command == "verify":
            return commands.verify(args.path, args.json)
        if args.command == "export":
            # what the libraries an export imports print (DeepSpeed's logger, progress bars) goes to stderr: stdout is the result
            with contextlib.redirect_stdout(sys.stderr), commands.exit_on_sigterm():
                doc = commands.export(args.path, Path(args.out), args.transformers, args.base)
            return commands.show(doc, args.json, commands.export_text)
        if args.command == "diff":
            with contextlib.redirect_stdout(sys.stderr):
                doc = commands.diff(args.a, args.b)
            commands.show(doc, args.json, commands.diff_text)
            return 0 if doc["equal"] else 1
        return commands.show(commands.inspect(args.path), args.json, commands.inspect_text)
    except commands.Refused as exc:
        print(f"trainfold {args.command}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ImportError, ValueError) as exc:  # a store that cannot be read: its package, its URL, the network
        print(f"trainfold {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
