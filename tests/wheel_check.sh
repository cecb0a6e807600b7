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
"$(dirname "$WHEEL_PY")/trainfold" ls . | grep -q "(no checkpoints)"  # the console script the wheel installs
echo "test-wheel: trainfold $version from $where: the digits example, the pytest plugin and the trainfold command ran"
