"""The documentation site's checks (docs/hooks.py), run here too: every public name in the API reference, each
docstring with the parts a reference needs; and the checks themselves catch what they are for."""

import importlib.util
from pathlib import Path

import trainfold

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)


def test_every_public_name_has_its_api_entry_and_a_complete_docstring():
    assert [] == hooks.reference_problems()
    assert set(hooks.api_entries()) >= set(trainfold.__all__) - {"__version__"}


def test_a_missing_docstring_section_is_named():
    """A function missing an argument returns raises or an example is named."""

    def scale(x: float, factor: float = 2.0) -> float:
        """Multiply.

        Args:
            x: the number.
        """
        return x * factor

    assert hooks.docstring_problems("scale", scale) == [
        "scale: argument 'factor' is not under Args",
        "scale: no Returns section",
        "scale: no Raises section",
        "scale: no Example section",
    ]


def test_a_second_examples_section_is_named():
    def scale(x: float) -> float:
        """Multiply by two.

        Args:
            x: the number.

        Returns:
            ``2 * x``.

        Raises:
            TypeError: ``x`` is not a number.

        Examples:
            >>> scale(2.0)
            4.0

        Examples:
            >>> halve(4.0)
            2.0
        """
        return 2 * x

    assert hooks.docstring_problems("scale", scale) == ["scale: more than one Examples section"]


def test_a_complete_docstring_passes_and_a_page_without_an_entry_is_found(tmp_path):
    def scale(x: float) -> float:
        """Multiply by two.

        Args:
            x: the number.

        Returns:
            ``2 * x``.

        Raises:
            TypeError: ``x`` is not a number.

        Examples:
            >>> scale(2.0)
            4.0
        """
        return 2 * x

    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "some.md").write_text("# Some\n\n::: trainfold.make_step\n\n::: trainfold.fit\n")

    assert hooks.docstring_problems("scale", scale) == []
    assert hooks.api_entries(tmp_path) == {"make_step": "some.md", "fit": "some.md"}
    missing = [p for p in hooks.reference_problems(tmp_path) if "no API page" in p]
    assert "evaluate: public, but no API page has '::: trainfold.evaluate'" in missing


def test_the_readme_becomes_the_home_page_with_the_sites_links():
    class Page:
        url = ""

    text = hooks.on_page_markdown('--8<-- "README.md"\n', Page())

    assert text.startswith("# trainfold")
    assert "](guides/step.md)" in text and "](docs/" not in text
    assert "](examples/" not in text  # the site does not hold the examples: their names stay, as text
    assert "](CONTRIBUTING.md)" not in text and "CONTRIBUTING.md" in text  # nor the contributors' page


def test_no_docstring_reference_names_something_that_does_not_exist():
    assert [] == hooks.stale_references()


def test_a_planted_stale_reference_is_found_and_live_ones_are_not(tmp_path, monkeypatch):
    """The checker on a package of its own: a moved module and a renamed method are found; a public name, a method
    named from inside its class, a name the module imports and a module path are not."""
    package = tmp_path / "src" / "planted_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(
        '"""Uses :func:`~trainfold.evaluate`, :mod:`trainfold._src.core.runtime`, :func:`compose` and :class:`Thing`."""\n'
        "from toolz import compose\n\n\n"
        "class Thing:\n"
        '    """See :meth:`go`, not :meth:`gone`; and :class:`trainfold.interrupt.Handlers`."""\n\n'
        "    def go(self):\n"
        '        """Go (:meth:`Thing.go`)."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path / "src"))

    found = hooks.stale_references(tmp_path / "src")

    assert found == [
        "planted_pkg/mod.py:6: :meth:`gone` names nothing that exists",
        "planted_pkg/mod.py:6: :class:`trainfold.interrupt.Handlers` names nothing that exists",
    ]


def test_a_docstring_into_the_implementation():
    """A public docstring that sends the reader into the implementation is a problem."""

    class Thing:
        """A thing (see :mod:`trainfold._src.core.stages`).

        Examples:
            >>> Thing()
        """

        def go(self):
            """Go: :func:`trainfold._src.core.step.record`."""

    assert hooks.docstring_problems("Thing", Thing) == [
        "Thing: its docstring sends the reader into the implementation (trainfold._src)",
        "Thing.go: its docstring sends the reader into the implementation (trainfold._src)",
    ]


def test_the_built_pages_are_read_back(tmp_path):
    """A planted site of two pages: a reST '::', a Sphinx role whose first colon a Returns section ate, a Returns
    section cut into a row per line, overloads as signatures, a link to a field with no anchor and one to a page the
    site lacks are each named with the entry they are under; the good links (same page, another page, a folder's
    index with directory URLs) are not."""
    api = tmp_path / "api"
    (api / "folder").mkdir(parents=True)
    (api / "folder" / "index.html").write_text('<h2 id="trainfold.Folder">Folder</h2>')
    (api / "state.html").write_text(
        '<h2 id="trainfold.TrainState">TrainState</h2><h3 id="trainfold.TrainState.step">step</h3>'
    )
    returns = (
        '<span class="doc-section-title">Returns:</span><table><tr class="doc-section-item"><td>TrainState</td></tr>'
        '<tr class="doc-section-item"><td>TrainState</td></tr></table>'
    )
    (api / "epochs.html").write_text(
        '<h2 id="trainfold.run_epoch">run_epoch</h2><div class="doc-overloads"></div><p>Per epoch::</p>'
        + returns
        + '<h2 id="trainfold.max_steps">max_steps</h2><p>class:<code>Stop</code>: see '
        '<a href="state.html#trainfold.TrainState.final_stop">final_stop</a>, <a href="state.html#trainfold.TrainState.step">step</a>, '
        '<a href="#trainfold.run_epoch">run_epoch</a>, <a href="folder/#trainfold.Folder">Folder</a>, <a href="gone.html#trainfold.x">x</a></p>'
    )
    (tmp_path / "404.html").write_text("<p>::</p>")  # the not-found page is not a reader's page

    assert hooks.html_problems(tmp_path) == [
        "api/epochs.html: a reST '::' shown as text (end the sentence with ':' and indent the block), under trainfold.run_epoch",
        "api/epochs.html: a Sphinx role shown as text, under trainfold.max_steps",
        "api/epochs.html: a function's overloads shown as signatures of their own, under trainfold.run_epoch",
        "api/epochs.html: a Returns section shown as several values, under trainfold.run_epoch",
        "api/epochs.html: a link to api/state.html#trainfold.TrainState.final_stop, which is no anchor there, under trainfold.max_steps",
        "api/epochs.html: a link to api/gone.html#trainfold.x, a page the site does not have, under trainfold.max_steps",
    ]
    (api / "epochs.html").write_text(
        '<h2 id="trainfold.run_epoch">run_epoch</h2><p>Per epoch:</p><pre><code>for batch in loader</code></pre>'
    )
    assert hooks.html_problems(tmp_path) == []


def test_every_train_state_field_has_a_docstring():
    """mkdocstrings renders a member, with its anchor (``trainfold.TrainState.stop``), only when it has a docstring:
    each field's is read as the site reads it (griffe, from the source), and the class's own docstring names each."""
    import attrs
    import griffe

    state = griffe.load("trainfold._src.core.state", search_paths=[str(ROOT / "src")])["TrainState"]

    for field in attrs.fields(trainfold.TrainState):
        assert state.members[field.name].docstring is not None, field.name
        assert f"``{field.name}``" in trainfold.TrainState.__doc__, field.name
