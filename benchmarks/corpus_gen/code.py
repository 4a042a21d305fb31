"""Code and technical English from CPython's standard library (PSF License; see llmjp_ds/data/corpus/LICENSE-PSF.txt).

Code documents are top-level functions and classes of pure-Python modules, cut with ``ast`` at definition
boundaries (with the module docstring first); English documents are the docstrings of the same kind of modules.
"""

from __future__ import annotations

import ast
import inspect
import sysconfig
from pathlib import Path

CODE_MODULES = [
    "bisect", "heapq", "textwrap", "fractions", "statistics", "string", "shlex", "calendar", "colorsys", "difflib",
    "fnmatch", "glob", "graphlib", "queue", "sched", "contextlib", "functools", "csv", "random", "base64",
    "ipaddress", "pprint", "reprlib", "operator", "copy", "numbers", "json/encoder", "json/decoder", "json/__init__",
    "html/__init__", "html/parser", "gettext", "locale", "dataclasses", "enum", "abc", "keyword", "netrc", "quopri",
    "uu", "wave", "zipapp", "tabnanny", "stringprep", "secrets", "hmac", "uuid", "codeop", "cmd", "timeit",
    "trace", "tokenize", "token", "linecache", "mimetypes", "configparser", "argparse", "optparse", "getopt",
    "filecmp", "shutil", "tempfile", "pathlib", "posixpath", "ntpath", "genericpath", "selectors", "weakref",
    "collections/__init__", "importlib/_abc", "email/utils", "email/quoprimime", "urllib/parse", "http/cookies",
    "logging/__init__", "unittest/case", "sqlite3/dump", "xml/dom/minidom", "concurrent/futures/_base",
]
DOC_MODULES = CODE_MODULES + ["asyncio/tasks", "asyncio/events", "threading", "subprocess", "socketserver",
                              "smtplib", "ftplib", "imaplib", "poplib", "zipfile", "tarfile", "ssl", "typing",
                              "inspect", "pydoc", "pickle", "datetime", "decimal", "ast", "dis", "bdb", "pdb"]


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read(module: str) -> str | None:
    path = _stdlib() / f"{module}.py"
    return path.read_text(encoding="utf-8") if path.exists() else None


def _sources(modules):
    """(module, source) of each listed module that this Python's standard library has."""
    for module in modules:
        source = _read(module)
        if source is not None:
            yield module, source


def code_documents(max_chars: int, min_chars: int = 300, max_doc: int = 6000) -> list[str]:
    docs: list[str] = []
    total = 0
    for module, source in _sources(CODE_MODULES):
        lines = source.splitlines(keepends=True)
        tree = ast.parse(source)
        chunk = ""
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            text = "".join(lines[first:node.end_lineno])
            if len(text) > max_doc:
                text = text[:max_doc].rsplit("\n", 1)[0] + "\n"
            chunk += ("\n\n" if chunk else "") + text
            if len(chunk) >= min_chars:
                docs.append(f"# {module.replace('/', '.')}.py\n\n{chunk}")
                total += len(docs[-1])
                chunk = ""
            if total >= max_chars:
                return docs
    return docs


def docstring_documents(max_chars: int, min_chars: int = 200) -> list[str]:
    docs: list[str] = []
    total = 0
    for module, source in _sources(DOC_MODULES):
        tree = ast.parse(source)
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                           ast.ClassDef))]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if not doc or len(doc) < min_chars:
                continue
            title = getattr(node, "name", module.replace("/", "."))
            docs.append(f"{title}\n\n{inspect.cleandoc(doc)}")
            total += len(docs[-1])
            if total >= max_chars:
                return docs
    return docs
