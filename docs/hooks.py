"""MkDocs hooks of trainfold's documentation site (mkdocs.yml names this file; it is not a page).

- The home page is the repository's README, the changelog page its CHANGELOG.md (``index.md`` and
  ``changelog.md`` name them): their links into ``docs/`` become the site's pages.
- Every public name (``trainfold.__all__``) must have an entry (``::: trainfold.NAME``) in a page of
  ``docs/api/``, and its docstring the parts a reference needs (:func:`docstring_problems`): each
  gap is a warning, which ``mkdocs build --strict`` (``make docs``, ``make test``) turns into a failure.
- Every Sphinx role in the sources (``:func:`~trainfold.evaluate```, ``:meth:`close```, in a docstring or a
  ``#:`` comment) must name something that exists (:func:`stale_references`): a module moved or a name renamed
  leaves a reference that is a warning too.
- Every built page is read back as a reader sees it (:func:`html_problems`): markup shown as text, a Returns
  section cut into rows, overloads, a link to an anchor that does not exist are warnings too.
  ``tests/test_docs.py`` runs the same checks in the in-process tests.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.trainfold")

DOCS = Path(__file__).resolve().parent
_ENTRY = re.compile(r"^::: trainfold\.(\w+)\s*$", re.M)


def api_entries(docs: Path = DOCS) -> dict[str, str]:
    """Each name with an API entry, and the page that has it."""
    return {
        name: page.name for page in sorted((docs / "api").glob("*.md")) for name in _ENTRY.findall(page.read_text())
    }


def _section(doc: str, title: str) -> str | None:
    """The indented body of a Google-style section (``Args:``...), or None when the docstring has none."""
    match = re.search(rf"^{title}:\n((?:[ \t]+.*\n|\n)*)", doc + "\n", re.M)
    return None if match is None else match.group(1)


def _function(obj: Any) -> Any:
    """The plain function behind a public callable (toolz's curry keeps it as ``.func``), or None for a class or a value."""
    func = getattr(obj, "func", obj)
    return func if inspect.isfunction(func) else None


def _alias_docstring(name: str) -> str | None:
    """The docstring under ``NAME = ...`` in trainfold's sources (a type alias's), or None."""
    for path in sorted((DOCS.parent / "src" / "trainfold").rglob("*.py")):
        match = re.search(rf'^{name} = .*\n"""(.+?)"""', path.read_text(), re.M | re.S)
        if match:
            return match.group(1)
    return None


SRC = DOCS.parent / "src"
_SOURCE_ROLE = re.compile(r":(?:func|class|attr|meth|mod|data|exc|obj):`~?([\w.]+)`")
_MISSING = object()


def _lookup(scope: Any, dotted: str) -> Any:
    """``scope.a.b`` for ``dotted`` ``"a.b"``, or ``_MISSING``; a module's submodule is imported where no attribute has its name."""
    for part in dotted.split("."):
        found = getattr(scope, part, _MISSING)
        if found is _MISSING and inspect.ismodule(scope):
            try:
                found = importlib.import_module(f"{scope.__name__}.{part}")
            except ImportError:
                found = _MISSING
        if found is _MISSING:
            return _MISSING
        scope = found
    return scope


def _resolves(target: str, module: Any, classes: list[Any]) -> bool:
    """Whether a role's target names something: from the enclosing classes outward, then the module, then as an import path."""
    first = target.split(".", 1)[0]
    for scope in (*reversed(classes), module):
        if hasattr(scope, first):
            return _lookup(scope, target) is not _MISSING
        if inspect.isclass(scope) and first in getattr(scope, "__annotations__", {}):  # a field with no class attribute
            return "." not in target
    try:
        top = importlib.import_module(first)
    except ImportError:
        return False
    rest = target.split(".", 1)[1] if "." in target else ""
    return not rest or _lookup(top, rest) is not _MISSING


def stale_references(src: Path = SRC) -> list[str]:
    """Every Sphinx role in the package's sources whose target names nothing (a moved module, a renamed function).

    Each ``.py`` file under ``src`` is imported as the module its path names; a role is resolved, Sphinx's way, in the
    classes around it (innermost first), then the module's names, then as an absolute path (``trainfold.x.y``).
    """
    problems = []
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        text = path.read_text()
        if _SOURCE_ROLE.search(text) is None or name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        spans = [
            (n.lineno, n.end_lineno or n.lineno, n.name)
            for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.ClassDef)
        ]
        for number, line in enumerate(text.splitlines(), 1):
            for match in _SOURCE_ROLE.finditer(line):
                around = sorted((s for s in spans if s[0] <= number <= s[1]), key=lambda s: s[0])
                classes = [c for c in (_lookup(module, s[2]) for s in around) if c is not _MISSING]
                if not _resolves(match.group(1), module, classes):
                    problems.append(f"{path.relative_to(src)}:{number}: {match.group(0)} names nothing that exists")
    return problems


def docstring_problems(name: str, obj: Any) -> list[str]:
    """What a public name's docstring lacks for the reference: a summary; for a function, each argument under
    ``Args:``, ``Returns:`` (unless it returns None), ``Raises:`` and an example; for a class, an example
    (exceptions excepted); for a type alias (``EpochFn = Callable[...]``), the docstring under it. One examples
    section at most: a second was, three times, another function's example pasted in the wrong docstring."""
    if isinstance(obj, str):
        return []
    if getattr(obj, "__module__", "") == "typing":  # an alias of a typing construct (Any, Callable[...])
        return [] if (_alias_docstring(name) or "").strip() else [f"{name}: a type alias with no docstring under it"]
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return [f"{name}: no docstring"]
    problems = (
        [f"{name}: its docstring sends the reader into the implementation (trainfold._src)"]
        if "trainfold._src" in doc
        else []
    )
    if inspect.isclass(obj):
        problems += [
            f"{name}.{k}: its docstring sends the reader into the implementation (trainfold._src)"
            for k, v in vars(obj).items()
            if not k.startswith("_") and "trainfold._src" in (inspect.getdoc(v) or "")
        ]
    func = _function(obj)
    if func is not None:
        signature = inspect.signature(func)
        params = [p for p in signature.parameters if p not in ("self", "cls")]
        args = _section(doc, "Args")
        if params and args is None:
            problems.append(f"{name}: no Args section (arguments {', '.join(params)})")
        for param in params if args is not None else ():
            if not re.search(rf"^\s+\**{param}\b[^:\n]*:", args, re.M):
                problems.append(f"{name}: argument {param!r} is not under Args")
        if signature.return_annotation not in (None, "None") and _section(doc, "Returns") is None:
            problems.append(f"{name}: no Returns section")
        if _section(doc, "Raises") is None:
            problems.append(f"{name}: no Raises section")
    if len(re.findall(r"^Examples?:$", doc, re.M)) > 1:  # a second one is another function's, pasted in the wrong place
        problems.append(f"{name}: more than one Examples section")
    exempt = inspect.isclass(obj) and issubclass(obj, BaseException) or not (func is not None or inspect.isclass(obj))
    if not exempt and _section(doc, "Example") is None and _section(doc, "Examples") is None:
        problems.append(f"{name}: no Example section")
    return problems


def reference_problems(docs: Path = DOCS) -> list[str]:
    """Every gap between ``trainfold.__all__`` and the API pages, and every docstring gap."""
    import trainfold

    public = [n for n in trainfold.__all__ if n != "__version__"]
    entries = api_entries(docs)
    problems = [f"{n}: public, but no API page has '::: trainfold.{n}'" for n in public if n not in entries]
    problems += [
        f"{n}: docs/api/{page} documents it, but it is not in trainfold.__all__"
        for n, page in entries.items()
        if n not in public and importlib.util.find_spec(f"trainfold.{n}") is None
    ]  # trainfold.testing: a public module
    for name in public:
        problems += docstring_problems(name, getattr(trainfold, name))
    return problems


#: the API pages' entries of this build (read once, by on_pre_build; every page's roles are linked to them)
_ENTRIES: dict[str, str] = {}


def on_pre_build(config: Any) -> None:
    _ENTRIES.clear()
    _ENTRIES.update(api_entries())
    for problem in reference_problems():
        log.warning("API reference: %s", problem)
    for problem in stale_references():
        log.warning("docstring reference: %s", problem)


_INCLUDE = re.compile(r'^--8<-- "([\w./-]+)"\s*$')
#: Links of the repository's files made the site's: into docs/ and to the changelog, pages; to the repository's
#: other files (examples/, benchmarks/), their text alone (the site does not hold them).
_LINKS = (
    (re.compile(r"\]\(docs/"), "]("),
    (re.compile(r"\]\(CHANGELOG\.md\)"), "](changelog.md)"),
    (re.compile(r"\[([^\]]*)\]\((?:(?:examples|benchmarks|tests|src)/[^)]*|CONTRIBUTING\.md)\)"), r"\1"),
)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """A page that is only ``--8<-- "FILE"`` is FILE from the repository's root (README.md, CHANGELOG.md), its links made the site's."""
    match = _INCLUDE.match(markdown.strip())
    if match is None:
        return markdown
    text = (DOCS.parent / match.group(1)).read_text()
    for pattern, replacement in _LINKS:
        text = pattern.sub(replacement, text)
    return text


_ROLE = re.compile(r":(?:func|class|attr|meth|mod|data|exc|obj):<code>(~?)([\w.]+)</code>")


def on_page_content(html: str, page: Any, files: Any, **_: Any) -> str:
    """The docstrings' Sphinx roles (``:func:`~trainfold.evaluate```, kept for ``help()``) as links to the API entries
    of the public names they name, and as plain code otherwise."""
    entries = _ENTRIES
    here = (
        posixpath.dirname(page.url) or "."
    )  # api/steps.html is in api/ (api/steps/ in api/steps, with directory URLs)

    def link(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2)
        text = target.rsplit(".", 1)[-1] if short else target
        parts = target.split(".")
        names = parts[1:] if parts[0] == "trainfold" else parts
        public = next((n for n in names[:1] if n in entries), None)
        if public is None:
            return f"<code>{text}</code>"
        anchor = "trainfold." + ".".join(names)
        href = posixpath.relpath(files.get_file_from_path(f"api/{entries[public]}").url, here) + f"#{anchor}"
        return f'<a href="{href}"><code>{text}</code></a>'

    return _ROLE.sub(link, html)


# --- the built pages, as a reader sees them -------------------------------------------------

_ID = re.compile(r'\bid="([^"]+)"')
_HREF = re.compile(r'\bhref="([^"#:]*)#([^"]+)"')  # a link inside the site (no scheme) to an anchor
_RETURNS = re.compile(r'doc-section-title">Returns:</span>(.*?)</table>', re.S)
#: what a docstring's markup leaves when the site does not understand it
_RAW = (
    (re.compile(r"::</p>"), "a reST '::' shown as text (end the sentence with ':' and indent the block)"),
    (
        re.compile(
            r"(?<![\w-])(?:func|class|meth|attr|data|exc|mod|obj):<code>|:(?:func|class|meth|attr|data|exc|mod|obj):`"
        ),
        "a Sphinx role shown as text",
    ),
    (re.compile(r'class="doc-overloads'), "a function's overloads shown as signatures of their own"),
)


def _where(html: str, at: int) -> str:
    """The API entry (``trainfold.NAME``) or section heading the text at ``at`` is under."""
    heads = re.findall(r'<h[1-6] id="([^"]+)"', html[:at])
    return heads[-1] if heads else "the page's top"


def html_problems(site: Path) -> list[str]:
    """What the built site shows wrong, page by page: reST and Sphinx markup left as text, a Returns section cut into a
    row per line, overloads as signatures, and a link to an anchor its page does not have (a renamed field, a moved
    entry)."""
    pages = {p.relative_to(site).as_posix(): p.read_text() for p in sorted(site.rglob("*.html"))}
    ids = {name: set(_ID.findall(html)) for name, html in pages.items()}
    problems = []
    for name, html in pages.items():
        if name == "404.html":
            continue
        for pattern, what in _RAW:
            problems += [f"{name}: {what}, under {_where(html, m.start())}" for m in pattern.finditer(html)]
        for m in _RETURNS.finditer(html):
            if m.group(1).count('class="doc-section-item"') > 1:
                problems.append(f"{name}: a Returns section shown as several values, under {_where(html, m.start())}")
        for m in _HREF.finditer(html):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), m.group(1))) if m.group(1) else name
            target = target if target in ids else f"{target}/index.html" if f"{target}/index.html" in ids else target
            if target not in ids:
                problems.append(
                    f"{name}: a link to {target}#{m.group(2)}, a page the site does not have, under {_where(html, m.start())}"
                )
            elif m.group(2) not in ids[target]:
                problems.append(
                    f"{name}: a link to {target}#{m.group(2)}, which is no anchor there, under {_where(html, m.start())}"
                )
    return problems


def on_post_build(config: Any) -> None:
    for problem in html_problems(Path(config.site_dir)):
        log.warning("built page: %s", problem)
