#!/usr/bin/env bash
# make test-wheel's checks, run from an empty folder so that `import trainfold` can only find the installed wheel.
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
where=$("$WHEEL_PY" -c "import trainfold, os; print(os.path.dirname(trainfold.__file__))")
case "$where" in
    */site-packages/trainfold) ;;
    *) echo "test-wheel: trainfold was imported from $where, not from the installed wheel" >&2; exit 1 ;;
esac
wheel=$(ls "$SRC"/dist/trainfold-*.whl)
version=$("$WHEEL_PY" -c "import trainfold; print(trainfold.__version__)")
case "$(basename "$wheel")" in
    "trainfold-$version-"*) ;;
    *) echo "test-wheel: the wheel $(basename "$wheel") is not version $version (trainfold.__version__)" >&2; exit 1 ;;
esac
cp "$SRC/examples/digits.py" .
"$WHEEL_PY" digits.py --smoke > digits.log
cat > test_with_the_plugin.py <<'PY'
def test_the_plugin_gives_the_isolated_fixture(isolated):
    from accelerate import Accelerator

    assert 2 == Accelerator(cpu=True, gradient_accumulation_steps=2).gradient_accumulation_steps
PY
"$WHEEL_PY" -m pytest -q -p no:cacheprovider test_with_the_plugin.py
# the console script the wheel installs, every command, on a checkpoint written by the installed package
cli="$(dirname "$WHEEL_PY")/trainfold"
"$cli" ls . | grep -q "(no checkpoints)"
"$WHEEL_PY" -c "from trainfold import save_checkpoint, testing; ctx, state, *_ = testing.tiny_setup(seed=0); save_checkpoint(ctx, 'ckpts', state)"
"$cli" ls ckpts | grep -q "ckpt-0000000000"
"$cli" verify ckpts | grep -q ": OK"
"$cli" inspect ckpts --json | "$WHEEL_PY" -c "import json, sys; assert json.load(sys.stdin)['trainfold_version'] == '$version'"
"$cli" export ckpts model.safetensors > /dev/null
"$cli" diff ckpts model.safetensors | grep -q "bit for bit"
echo "test-wheel: trainfold $version from $where: the digits example, the pytest plugin and the trainfold command (ls, verify, inspect, export, diff) ran"
