"""SGLang's HTTP contract, read from SGLang's own source in its PyPI wheel (for tests).

homegym talks to real SGLang servers over HTTP; the contract tests check every route
and request key homegym uses against the source of the pinned SGLang versions. Nothing
here imports sglang (it needs torch, CUDA, ...) and no copy of the routes is kept: the
wheel is downloaded once per version into the cache and its source parsed with ``ast``
on every run.

    from sglang_source import SglangSourceUnavailable, contract

    c = contract("0.5.23")   # cached Contract(...); SglangSourceUnavailable if pip cannot get it
    r = c.route("/update_weights_from_disk", "POST")     # None: no such route/method
    r.request_struct                       # "UpdateWeightFromDiskReqInput"
    c.request_fields("/update_weights_from_disk")        # {"model_path", "flush_cache", ...}
    c.request_fields("/remove_external_corpus")          # None: raw Request, keys unknowable
    c.struct_info("UpdateWeightFromDiskReqInput").required   # {"model_path"}
    c.sampling_param_names                 # what SamplingParams(**sampling_params) accepts
    c.schema_sampling_param_names          # 0.5.23+: the /generate JSON schema (strict), else None

Where the bodies go: the native routes' structs are msgspec Structs (``io_struct.py``)
that FastAPI validates through a pydantic core schema with ``extra_behavior="ignore"``,
so an unknown top-level key is dropped silently (hence these tests). ``sampling_params``
becomes ``SamplingParams(**d)`` (a TypeError on an unknown key). From 0.5.23 a ``/generate``
body is first checked against the generated schema ``sglang/api/v1/api_types.py``, whose
SamplingParams rejects unknown keys with a 400 (``RouteInfo.schema_struct``).

Files read: http_server.py and every module its routes' types come from (imports are
followed inside the wheel: io_struct.py, openai/protocol.py, included routers, ...).
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
OPENAI_PROTOCOL = "sglang/srt/entrypoints/openai/protocol.py"
API_TYPES = "sglang/api/v1/api_types.py"  # 0.5.23+: the generated JSON-contract schema

# Extracted up front; any other module a route's types or routers come from is
# extracted on first use (the wheel stays in the cache directory).
SOURCE_FILES = (HTTP_SERVER, IO_STRUCT, SAMPLING_PARAMS, OPENAI_PROTOCOL, API_TYPES,
                "sglang/srt/entrypoints/api_contract.py", "sglang/version.py",
                "sglang/srt/server_args.py")

# If the host has no wheel of its own (e.g. macOS: SGLang publishes manylinux wheels
# only), any platform's wheel will do: the Python sources are the same in all of them.
_FALLBACK_TARGET = ["--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
                    "--implementation", "cp", "--abi", "cp311"]

_DOWNLOAD_TIMEOUT_S = 900
_NOT_STRUCTS = {"Request", "WebSocket", "Response", "BackgroundTasks", "HTTPConnection",
                "ORJSONRequest", "UploadFile"}
_SCALARS = {"int", "float", "str", "bool", "bytes", "None", "Any", "List", "list", "Dict",
            "dict", "Set", "set", "Tuple", "tuple", "Literal"}
_HTTP_DECORATORS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE",
                    "patch": "PATCH", "head": "HEAD", "options": "OPTIONS",
                    "trace": "TRACE", "websocket": "WEBSOCKET"}


class SglangSourceUnavailable(RuntimeError):
    """The SGLang wheel could not be downloaded (offline, unknown version, ...)."""


# ---------------------------------------------------------------- the wheel


def cache_root() -> Path:
    return Path(os.environ.get("HOMEGYM_CACHE") or Path.home() / ".cache" / "homegym")


def wheel_dir(version: str) -> Path:
    """``$HOMEGYM_CACHE/sglang-wheels/VERSION/``: the downloaded wheel (reused when
    there) and, under ``src/``, the source files extracted from it. Safe to call from
    concurrent test processes (a file lock). Raises SglangSourceUnavailable."""
    if not re.fullmatch(r"[0-9A-Za-z.+!-]+", version):
        raise ValueError(f"not a version: {version!r}")
    # The fast-tier guard (conftest) counts this as a process start even when the wheel is
    # cached: on a fresh clone it is one (pip download), and a warm cache must not hide it.
    sys.audit("homegym.sglang_wheel", version)
    d = cache_root() / "sglang-wheels" / version
    d.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(d) + ".lock"):
        wheel = _find_wheel(d, version)
        if wheel is None:
            wheel = _download(d, version)
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            if HTTP_SERVER not in names:
                raise SglangSourceUnavailable(f"{wheel} has no {HTTP_SERVER}")
            for rel in SOURCE_FILES:
                if rel in names:
                    _extract(zf, rel, d / "src")
    return d


def source_text(version: str, rel: str) -> str:
    """The text of any file of the wheel (``sglang/srt/models/qwen3_5.py``), extracted into
    the cache on first use. Raises SglangSourceUnavailable, or KeyError when not there."""
    d = wheel_dir(version)
    target = d / "src" / rel
    if not target.exists():
        from filelock import FileLock

        with FileLock(str(d) + ".lock"), zipfile.ZipFile(_find_wheel(d, version)) as zf:
            _extract(zf, rel, d / "src")
    return target.read_text(encoding="utf-8")


def _find_wheel(d: Path, version: str) -> Path | None:
    # Wheels only ever land here by an atomic rename, so one that is there is whole.
    for w in sorted(d.glob(f"sglang-{version}-*.whl")):
        if zipfile.is_zipfile(w):
            return w
        w.unlink()
    return None


def _download(d: Path, version: str) -> Path:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    errors = []
    for extra in ([], _FALLBACK_TARGET):
        tmp = Path(tempfile.mkdtemp(prefix=".download.", dir=d))
        try:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--dest", str(tmp), *extra, f"sglang=={version}"]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                   timeout=_DOWNLOAD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                errors.append(f"{' '.join(cmd)}: timed out after {_DOWNLOAD_TIMEOUT_S}s")
                continue
            got = sorted(tmp.glob(f"sglang-{version}-*.whl"))
            if p.returncode == 0 and got:
                target = d / got[0].name
                os.replace(got[0], target)
                return target
            out = (p.stdout + p.stderr).strip()
            errors.append(f"{' '.join(cmd)} -> exit {p.returncode}:\n"
                          + "\n".join(out.splitlines()[-15:]))
            if "No matching distribution" not in out or re.search(
                    r"Retrying|ConnectionError|Failed to establish|timed out|versions: none", out):
                break  # offline or failing: another platform's wheel will not help
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    raise SglangSourceUnavailable(f"cannot download the sglang=={version} wheel from the "
                                  "package index:\n" + "\n\n".join(errors))


def _extract(zf: zipfile.ZipFile, rel: str, root: Path) -> Path:
    target = root / rel
    data = zf.read(rel)
    if target.exists() and target.read_bytes() == data:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".x.", dir=target.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, target)
    return target


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class FieldInfo:
    name: str              # the JSON key (a pydantic alias when there is one)
    required: bool
    annotation: str
    line: int
    default: str | None = None   # the default's source text; None when required


@dataclass(frozen=True)
class StructInfo:
    name: str
    kind: str              # "msgspec" | "dataclass" | "pydantic" | "class"
    file: str              # path inside the wheel
    line: int
    fields: dict[str, FieldInfo]   # inherited ones included, in declaration order
    # What an unknown key does where the source says so: "ignore" | "forbid" | "allow";
    # None: not stated (pydantic models and dataclasses then ignore unknown keys).
    extra: str | None = None
    bases: tuple[str, ...] = ()

    @property
    def names(self) -> set[str]:
        return set(self.fields)

    @property
    def required(self) -> set[str]:
        return {n for n, f in self.fields.items() if f.required}


@dataclass(frozen=True)
class RouteInfo:
    """One registration (decorator) of a route."""
    path: str
    methods: frozenset[str]
    handler: str
    file: str
    line: int                     # the decorator's line
    # The struct the JSON body is validated into, or None (no body, or a raw Request).
    request_struct: str | None = None
    struct_module: str | None = None   # e.g. "sglang.srt.managers.io_struct"
    struct_from: str | None = None     # "annotation" | "body" (parsed inside the handler)
    body_optional: bool = False        # `obj: Optional[X] = None`: an empty body is fine
    raw_body: bool = False             # the handler reads request.json()/body() itself
    body_keys: frozenset[str] = frozenset()   # keys a raw handler reads (.get("k"), ["k"])
    query_params: frozenset[str] = frozenset()
    path_params: frozenset[str] = frozenset()
    conditional: bool = False          # registered under an `if` at import time
    always_error: int | None = None    # the handler only raises HTTPException(status)
    schema_struct: str | None = None   # api_types struct the raw JSON is also checked with
    router: str | None = None          # "app", or the included router's module
    merged: int = 0  # Contract.routes only: how many registrations this entry unites


# ---------------------------------------------------------------- parsing helpers


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _last(name: str | None) -> str | None:
    return name.rsplit(".", 1)[-1] if name else None


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _const(node, consts: dict[str, str] | None = None):
    """A literal value, following module-level string constants and
    os.environ.get(NAME, "default") / os.getenv(NAME, "default") (-> the default)."""
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and consts and node.id in consts:
        return consts[node.id]
    if isinstance(node, ast.Call) and _dotted(node.func) in ("os.environ.get", "os.getenv",
                                                              "environ.get", "getenv"):
        if len(node.args) >= 2:
            return _const(node.args[1], consts)
        d = _kw(node, "default")
        return _const(d, consts) if d is not None else None
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        vals = [_const(e, consts) for e in node.elts]
        return None if any(v is None for v in vals) else vals
    return None


class _Module:
    """One parsed source file of the wheel."""

    def __init__(self, name: str, rel: str, text: str):
        self.name, self.rel = name, rel
        self.tree = ast.parse(text, filename=rel)
        self.lines = text.splitlines()
        self.imports: dict[str, tuple[str, str | None]] = {}  # local -> (module, attr|None)
        self.classes: dict[str, ast.ClassDef] = {}
        self.functions: dict[str, ast.AST] = {}
        self.consts: dict[str, str] = {}
        for node in _walk_toplevel(self.tree.body):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self._add_import(node, self.imports)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                v = _const(node.value)
                if isinstance(v, str):
                    self.consts.setdefault(node.targets[0].id, v)

    def _add_import(self, node, into: dict):
        if isinstance(node, ast.Import):
            for a in node.names:
                into[a.asname or a.name.split(".")[0]] = (a.name if a.asname else
                                                          a.name.split(".")[0], None)
        else:
            mod = node.module or ""
            if node.level:
                pkg = self.name.split(".")
                pkg = pkg[:len(pkg) - node.level]
                mod = ".".join(pkg + ([mod] if mod else []))
            for a in node.names:
                into[a.asname or a.name] = (mod, a.name)

    def local_imports(self, fn) -> dict:
        out = dict(self.imports)
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._add_import(node, out)
        return out


def _walk_toplevel(body, conditional=False, with_flag=False):
    """Module-level statements, descending into if/try/with blocks (not functions)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _walk_toplevel(node.body, True, with_flag)
            yield from _walk_toplevel(node.orelse, True, with_flag)
        elif isinstance(node, ast.Try):
            for b in (node.body, node.orelse, node.finalbody):
                yield from _walk_toplevel(b, conditional, with_flag)
            for h in node.handlers:
                yield from _walk_toplevel(h.body, True, with_flag)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _walk_toplevel(node.body, conditional, with_flag)
        else:
            yield (node, conditional) if with_flag else node


def _unwrap_annotation(node) -> tuple[list[ast.AST], bool, list[ast.AST]]:
    """(candidate type nodes, optional?, Annotated metadata) of a parameter annotation."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return [], False, []
    meta: list[ast.AST] = []
    optional = False
    todo, out = [node], []
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Subscript):
            head = _last(_dotted(n.value))
            sl = n.slice
            elts = list(sl.elts) if isinstance(sl, ast.Tuple) else [sl]
            if head == "Annotated":
                todo.append(elts[0])
                meta += elts[1:]
                continue
            if head == "Optional":
                optional = True
                todo += elts
                continue
            if head == "Union":
                todo += elts
                continue
            out.append(n)
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr):
            todo += [n.left, n.right]
        elif isinstance(n, ast.Constant) and n.value is None:
            optional = True
        else:
            out.append(n)
    return out, optional, meta


# ---------------------------------------------------------------- the contract


class Contract:
    """SGLang VERSION's HTTP routes and request structs, from its wheel's source."""

    def __init__(self, version: str, root: Path | str | None = None):
        """``root``: an already-extracted tree (a directory holding ``sglang/``);
        by default the wheel is downloaded into the cache (wheel_dir)."""
        self.version = version
        if root is None:
            d = wheel_dir(version)
            self.root = d / "src"
            self._wheel = _find_wheel(d, version)
        else:
            self.root, self._wheel = Path(root), None
        self._modules: dict[str, _Module | None] = {}
        self._structs: dict[tuple[str, str], StructInfo | None] = {}
        self.unresolved: list[str] = []   # registrations whose path is not a literal
        self.endpoints: tuple[RouteInfo, ...] = tuple(self._parse_routes())

    # ---- public API

    @functools.cached_property
    def routes(self) -> dict[str, RouteInfo]:
        """path -> its registration. A path registered by several handlers (e.g. one per
        method) maps to a merged entry: methods united, handler "a|b", request_struct
        kept only when they agree; use route(path, method) for the exact one."""
        by_path: dict[str, list[RouteInfo]] = {}
        for r in self.endpoints:
            by_path.setdefault(r.path, []).append(r)
        out = {}
        for path, rs in by_path.items():
            if len(rs) == 1:
                out[path] = rs[0]
                continue
            same = len({(r.request_struct, r.struct_module, r.raw_body) for r in rs}) == 1
            out[path] = RouteInfo(
                path=path, methods=frozenset().union(*(r.methods for r in rs)),
                handler="|".join(dict.fromkeys(r.handler for r in rs)), file=rs[0].file,
                line=rs[0].line,
                request_struct=rs[0].request_struct if same else None,
                struct_module=rs[0].struct_module if same else None,
                struct_from=rs[0].struct_from if same else None,
                raw_body=rs[0].raw_body if same else False,
                query_params=frozenset().union(*(r.query_params for r in rs)),
                path_params=rs[0].path_params,
                conditional=all(r.conditional for r in rs), router=rs[0].router,
                merged=len(rs))
        return out

    def route(self, path: str, method: str | None = None) -> RouteInfo | None:
        """The registration that serves METHOD on PATH (the first one, as in FastAPI);
        without a method, the path's only registration (or the merged entry)."""
        if method is None:
            return self.routes.get(path)
        method = method.upper()
        for r in self.endpoints:
            if r.path == path and method in r.methods:
                return r
        return None

    def request_fields(self, path: str, method: str | None = None) -> set[str] | None:
        """The JSON keys the route's request struct accepts; set() for a route without
        a body; None when the handler takes a raw Request (keys cannot be checked)."""
        r = self.route(path, method)
        if r is None:
            raise KeyError(f"sglang {self.version} has no route {method or ''} {path}".strip())
        if r.merged and r.request_struct is None and any(
                e.request_struct or e.raw_body for e in self.endpoints if e.path == path):
            raise ValueError(f"sglang {self.version}: {path} has one handler per method "
                             f"({', '.join(sorted(r.methods))}): pass the method")
        if r.request_struct is None:
            return None if r.raw_body else set()
        return self.struct_fields(r.request_struct, r.struct_module)

    def struct_fields(self, name: str, module: str | None = None) -> set[str]:
        return self.struct_info(name, module).names

    def struct_info(self, name: str, module: str | None = None) -> StructInfo:
        """A request struct by class name: from MODULE, else io_struct.py, else the
        OpenAI protocol, else any module already read. KeyError if none has it."""
        mods = [module] if module else []
        mods += ["sglang.srt.managers.io_struct", "sglang.srt.entrypoints.openai.protocol"]
        mods += [m for m in self._modules if m not in mods]
        for m in mods:
            info = self._struct(m, name)
            if info is not None:
                return info
        raise KeyError(f"sglang {self.version}: no struct {name!r}")

    @functools.cached_property
    def sampling_params(self) -> StructInfo:
        """sglang.srt.sampling.sampling_params.SamplingParams (fields, or __init__'s
        parameters where it is a plain class)."""
        info = self._struct("sglang.srt.sampling.sampling_params", "SamplingParams")
        if info is None:
            raise KeyError(f"sglang {self.version}: no SamplingParams in {SAMPLING_PARAMS}")
        return info

    @property
    def sampling_param_names(self) -> set[str]:
        """Every key SamplingParams(**sampling_params) accepts (internal fields too)."""
        return self.sampling_params.names

    @functools.cached_property
    def sampling_param_api_names(self) -> set[str]:
        """sampling_param_names less the fields after the class's "Internal fields"
        comment (set by normalize(), not by callers); all of them if there is none."""
        info, mod = self.sampling_params, self._module("sglang.srt.sampling.sampling_params")
        cls = mod.classes["SamplingParams"]
        end = getattr(cls, "end_lineno", len(mod.lines))
        cut = next((i + 1 for i in range(cls.lineno, end)
                    if re.match(r"\s*#.*internal fields", mod.lines[i], re.I)), None)
        return {n for n, f in info.fields.items() if cut is None or f.line < cut}

    def schema_struct_info(self, name: str) -> StructInfo | None:
        """A struct of the generated JSON-contract schema (api_types.py, 0.5.23+), with
        extra="forbid" where it rejects unknown keys; None when there is no schema."""
        return self._struct("sglang.api.v1.api_types", name)

    @property
    def schema_sampling_param_names(self) -> set[str] | None:
        """The sampling_params keys the /generate schema admits (it rejects any other
        with a 400), or None for a version without the schema."""
        r = self.route("/generate", "POST")
        if r is None or r.schema_struct is None:
            return None
        info = self.schema_struct_info("SamplingParams")
        return info.names if info else None

    @property
    def server_version(self) -> str | None:
        """The version string read from the wheel's metadata."""
        if self._wheel is None:
            return None
        with zipfile.ZipFile(self._wheel) as zf:
            meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
            if meta:
                m = re.search(r"^Version: (\S+)", zf.read(meta).decode(), re.M)
                return m.group(1) if m else None
        return None

    # ---- modules

    def _module(self, name: str) -> _Module | None:
        if name in self._modules:
            return self._modules[name]
        mod = None
        for rel in (name.replace(".", "/") + ".py", name.replace(".", "/") + "/__init__.py"):
            p = self.root / rel
            if not p.exists() and self._wheel is not None:
                with zipfile.ZipFile(self._wheel) as zf:
                    if rel in zf.namelist():
                        _extract(zf, rel, self.root)
            if p.exists():
                mod = _Module(name, rel, p.read_text(encoding="utf-8"))
                break
        self._modules[name] = mod
        return mod

    def _resolve(self, mod: _Module, name: str, imports: dict | None = None,
                 depth: int = 0) -> tuple[_Module, str] | None:
        """(module, class name) that NAME refers to in MOD (following imports)."""
        if depth > 8:
            return None
        if name in mod.classes:
            return mod, name
        imp = (imports or mod.imports).get(name)
        if imp is None or imp[1] is None or not imp[0].startswith("sglang"):
            return None
        target = self._module(imp[0])
        if target is None:
            return None
        return self._resolve(target, imp[1], None, depth + 1)

    # ---- structs

    def _struct(self, module: str, name: str) -> StructInfo | None:
        key = (module, name)
        if key not in self._structs:
            self._structs[key] = None  # cycles
            mod = self._module(module)
            self._structs[key] = self._parse_struct(mod, name) if mod else None
        return self._structs[key]

    def _parse_struct(self, mod: _Module, name: str) -> StructInfo | None:
        cls = mod.classes.get(name)
        if cls is None:
            hit = self._resolve(mod, name)
            if hit is None or hit[0] is mod:
                return None
            return self._struct(hit[0].name, hit[1])
        kind, extra = None, None
        fields: dict[str, FieldInfo] = {}
        base_names = []
        for b in cls.bases:
            bn = _dotted(b.value if isinstance(b, ast.Subscript) else b) or ""
            base_names.append(bn)
            if bn in ("msgspec.Struct", "Struct"):
                kind = kind or "msgspec"
            elif _last(bn) == "BaseModel":
                kind = kind or "pydantic"
            else:
                hit = self._resolve(mod, _last(bn)) if bn else None
                base = self._struct(hit[0].name, hit[1]) if hit else None
                if base is not None:
                    kind = kind or (base.kind if base.kind != "class" else None)
                    extra = extra or base.extra
                    fields.update(base.fields)
        for d in cls.decorator_list:
            dn = _dotted(d.func if isinstance(d, ast.Call) else d) or ""
            if _last(dn) == "dataclass":
                kind = "dataclass"
        kind = kind or "class"
        populate_by_name = False
        for kw in cls.keywords:  # class X(msgspec.Struct, forbid_unknown_fields=True)
            if kw.arg == "forbid_unknown_fields" and _const(kw.value) is True:
                extra = "forbid"
            if kw.arg == "extra":
                extra = _const(kw.value) or extra
        doc = ast.get_docstring(cls) or ""
        if re.search(r"unknown keys rejected", doc):
            extra = "forbid"
        elif re.search(r"unknown keys ignored", doc):
            extra = "ignore"
        for node in cls.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "model_config" for t in node.targets):
                extra, populate_by_name = self._model_config(node.value, extra)
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            fname = node.target.id
            ann = ast.unparse(node.annotation)
            if fname == "model_config":
                if node.value is not None:
                    extra, populate_by_name = self._model_config(node.value, extra)
                continue
            if re.match(r"(typing\.)?ClassVar\b", ann) or (
                    kind == "pydantic" and fname.startswith("_")):
                continue
            required, key, init = self._field_default(node.value)
            dflt = None if required or node.value is None else ast.unparse(node.value)
            if not init:
                continue
            fields.pop(fname, None)
            if key and key != fname:
                fields[key] = FieldInfo(key, required, ann, node.lineno, dflt)
                if not populate_by_name:
                    continue
            fields[fname] = FieldInfo(fname, required, ann, node.lineno, dflt)
        if kind == "class" and not fields:
            init = next((n for n in cls.body if isinstance(n, ast.FunctionDef)
                         and n.name == "__init__"), None)
            if init is not None:
                a = init.args
                pos = a.posonlyargs + a.args
                defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
                for arg, d in list(zip(pos, defaults))[1:] + list(zip(a.kwonlyargs,
                                                                       a.kw_defaults)):
                    fields[arg.arg] = FieldInfo(
                        arg.arg, d is None, ast.unparse(arg.annotation) if arg.annotation
                        else "", arg.lineno, None if d is None else ast.unparse(d))
        if kind == "msgspec" and extra is None:
            # FastAPI validates sglang's msgspec Structs via msgspec_struct_pydantic_core_schema
            # (extra_behavior="ignore"); record that only where the source says so.
            extra = self._msgspec_http_extra(mod, cls)
        return StructInfo(name=name, kind=kind, file=mod.rel, line=cls.lineno,
                          fields=fields, extra=extra, bases=tuple(base_names))

    @staticmethod
    def _model_config(node, extra):
        populate = False
        if isinstance(node, ast.Call):
            e = _kw(node, "extra")
            extra = _const(e) if e is not None and isinstance(_const(e), str) else extra
            for k in ("populate_by_name", "validate_by_name"):
                if _const(_kw(node, k)) is True:
                    populate = True
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if _const(k) == "extra" and isinstance(_const(v), str):
                    extra = _const(v)
                if _const(k) in ("populate_by_name", "validate_by_name") and _const(v) is True:
                    populate = True
        return extra, populate

    @staticmethod
    def _field_default(value) -> tuple[bool, str | None, bool]:
        """(required, alias, in __init__) for a field's assigned value."""
        if value is None:
            return True, None, True
        if isinstance(value, ast.Call) and _last(_dotted(value.func)) in ("field", "Field"):
            if _const(_kw(value, "init")) is False:
                return False, None, False
            alias = _const(_kw(value, "alias")) or _const(_kw(value, "validation_alias"))
            has_default = any(k.arg in ("default", "default_factory") for k in value.keywords)
            if value.args:  # pydantic Field(...) (required) / Field(default)
                a0 = value.args[0]
                has_default = not (isinstance(a0, ast.Constant) and a0.value is Ellipsis)
            return not has_default, alias if isinstance(alias, str) else None, True
        return False, None, True

    def _msgspec_http_extra(self, mod: _Module, cls: ast.ClassDef) -> str | None:
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef) and node.name == "__get_pydantic_core_schema__":
                for c in ast.walk(node):
                    if isinstance(c, ast.Call) and _last(_dotted(c.func)) == \
                            "msgspec_struct_pydantic_core_schema":
                        hit = mod.imports.get("msgspec_struct_pydantic_core_schema")
                        util = self._module(hit[0]) if hit else None
                        fn = util.functions.get("msgspec_struct_pydantic_core_schema") \
                            if util else None
                        for k in ast.walk(fn) if fn else ():
                            if isinstance(k, ast.keyword) and k.arg == "extra_behavior":
                                return _const(k.value)
        return None

    # ---- routes

    def _parse_routes(self) -> list[RouteInfo]:
        server = self._module("sglang.srt.entrypoints.http_server")
        if server is None:
            raise SglangSourceUnavailable(f"{self.root} has no {HTTP_SERVER}")
        routes = self._routes_in(server, {"app"}, prefix="", router="app")
        # Routers included into the app: app.include_router(X, prefix=...).
        for node in _walk_toplevel(server.tree.body):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                    _dotted(node.value.func) == "app.include_router" and node.value.args:
                local = _dotted(node.value.args[0])
                prefix = _const(_kw(node.value, "prefix"), server.consts) or ""
                imp = server.imports.get(local)
                if imp is None or imp[1] is None:
                    self.unresolved.append(f"{server.rel}:{node.lineno}: include_router({local})")
                    continue
                mod = self._module(imp[0])
                if mod is None:
                    self.unresolved.append(f"{server.rel}:{node.lineno}: module {imp[0]}")
                    continue
                routes += self._routes_in(mod, {imp[1]}, prefix=prefix, router=imp[0])
        return routes

    def _routes_in(self, mod: _Module, apps: set[str], prefix: str, router: str):
        out = []
        for node, cond in _walk_toplevel(mod.tree.body, with_flag=True):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    reg = self._registration(mod, dec, apps)
                    if reg is not None:
                        out += self._route_infos(mod, reg, node, dec.lineno, cond, prefix,
                                                 router)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                call = node.value
                fn = _dotted(call.func) or ""
                if fn.rsplit(".", 1)[0] in apps and _last(fn) in ("add_api_route", "add_route",
                                                                 "add_api_websocket_route"):
                    path = _const(call.args[0] if call.args else _kw(call, "path"), mod.consts)
                    ep = call.args[1] if len(call.args) > 1 else _kw(call, "endpoint")
                    methods = _const(_kw(call, "methods"), mod.consts)
                    if _last(fn) == "add_api_websocket_route":
                        methods = ["WEBSOCKET"]
                    handler = mod.functions.get(_dotted(ep) or "")
                    if not isinstance(path, str) or handler is None:
                        self.unresolved.append(f"{mod.rel}:{node.lineno}: {ast.unparse(call)}")
                        continue
                    out += self._route_infos(mod, (path, methods or ["GET"]), handler,
                                             node.lineno, cond, prefix, router)
        return out

    def _registration(self, mod, dec, apps) -> tuple[str, list[str]] | None:
        if not isinstance(dec, ast.Call):
            return None
        fn = _dotted(dec.func) or ""
        owner, _, verb = fn.rpartition(".")
        if owner not in apps:
            return None
        if verb in _HTTP_DECORATORS:
            methods = [_HTTP_DECORATORS[verb]]
        elif verb in ("api_route", "route"):
            methods = _const(_kw(dec, "methods"), mod.consts) or ["GET"]
        else:
            return None
        path_node = dec.args[0] if dec.args else _kw(dec, "path")
        path = _const(path_node, mod.consts)
        if not isinstance(path, str):
            self.unresolved.append(f"{mod.rel}:{dec.lineno}: @{ast.unparse(dec)}")
            return None
        return path, [m.upper() for m in methods]

    def _route_infos(self, mod, reg, fn, line, cond, prefix, router) -> list[RouteInfo]:
        path, methods = reg
        path = prefix + path
        imports = mod.local_imports(fn)
        path_params = set(re.findall(r"\{(\w+)(?::[^}]*)?\}", path))
        struct = struct_mod = struct_from = None
        body_optional = False
        query = set()
        args = fn.args
        pos = args.posonlyargs + args.args
        defaults = [None] * (len(pos) - len(args.defaults)) + list(args.defaults)
        params = list(zip(pos, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
        request_names = set()
        for arg, dflt in params:
            cands, optional, meta = _unwrap_annotation(arg.annotation) if arg.annotation \
                else ([], False, [])
            names = [_last(_dotted(c.value if isinstance(c, ast.Subscript) else c))
                     for c in cands]
            names = [n for n in names if n]
            if any(n in _NOT_STRUCTS for n in names):
                request_names.add(arg.arg)
                continue
            if arg.arg in path_params:
                continue
            if any(_last(_dotted(m.func)) in ("Depends", "Security") for m in
                   meta + ([dflt] if dflt is not None else []) if isinstance(m, ast.Call)):
                continue  # a dependency, not part of the request
            is_body = any(_last(_dotted(m.func if isinstance(m, ast.Call) else m)) in
                          ("Body", "Form", "File") for m in meta + ([dflt] if dflt else []))
            is_query = any(_last(_dotted(m.func if isinstance(m, ast.Call) else m)) == "Query"
                           for m in meta + ([dflt] if dflt is not None else [])
                           if isinstance(m, (ast.Call, ast.Name, ast.Attribute)))
            hit = None
            for n in names:
                if n not in _SCALARS:
                    hit = self._resolve(mod, n, imports)
                    if hit:
                        break
            if hit and not is_query:
                if struct is None:
                    struct, struct_mod, struct_from = hit[1], hit[0].name, "annotation"
                    body_optional = optional or (dflt is not None and _const(dflt) is None
                                                 and isinstance(dflt, ast.Constant))
                continue
            if is_body:
                continue
            query.add(arg.arg)
        raw = False
        body_keys: set[str] = set()
        if struct is None and request_names:
            struct, struct_mod, raw, body_keys = self._body_struct(mod, fn, imports,
                                                                   request_names)
            struct_from = "body" if struct else None
        schema = self._schema_check(mod, fn, imports)
        return [RouteInfo(
            path=path, methods=frozenset(methods), handler=fn.name, file=mod.rel, line=line,
            request_struct=struct, struct_module=struct_mod, struct_from=struct_from,
            body_optional=body_optional, raw_body=raw, body_keys=frozenset(body_keys),
            query_params=frozenset(query), path_params=frozenset(path_params),
            conditional=cond, always_error=self._always_error(fn), schema_struct=schema,
            router=router)]

    def _body_struct(self, mod, fn, imports, request_names):
        """A handler taking a raw Request: X(**await request.json()), msgspec decode
        into X, X.model_validate(...), ... Returns (struct, module, raw, keys)."""
        json_vars: set[str] = set()
        reads_body = False

        def is_body_read(n) -> bool:
            if isinstance(n, ast.Await):
                n = n.value
            return isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                n.func.attr in ("json", "body", "form", "stream") and \
                _dotted(n.func.value) in request_names

        def involves_body(n) -> bool:
            return any(is_body_read(x) or (isinstance(x, ast.Name) and x.id in json_vars)
                       for x in ast.walk(n))

        for n in ast.walk(fn):
            if is_body_read(n):
                reads_body = True
            if isinstance(n, ast.Assign) and is_body_read(   # body = await request.json()
                    n.value.body if isinstance(n.value, ast.IfExp) else n.value):
                json_vars |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            fname = _dotted(n.func) or ""
            cand = None
            if any(k.arg is None and involves_body(k.value) for k in n.keywords):
                cand = _last(fname)                                   # X(**body)
            elif _last(fname) in ("model_validate", "model_validate_json", "parse_obj",
                                  "parse_raw", "from_json_value", "from_dict") and \
                    n.args and involves_body(n.args[0]):
                cand = _last(fname.rsplit(".", 1)[0])                 # X.model_validate(body)
            elif fname.endswith(("msgspec.json.decode", "msgspec.convert", "json.decode",
                                 "convert")) and n.args and involves_body(n.args[0]):
                t = _kw(n, "type") or (n.args[1] if len(n.args) > 1 else None)
                cand = _last(_dotted(t)) if t is not None else None   # decode(b, type=X)
            if cand:
                hit = self._resolve(mod, cand, imports)
                if hit and self._struct(hit[0].name, hit[1]) is not None:
                    return hit[1], hit[0].name, False, set()
        keys = set()
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                    n.func.attr in ("get", "pop") and _dotted(n.func.value) in json_vars and \
                    n.args and isinstance(_const(n.args[0]), str):
                keys.add(_const(n.args[0]))
            elif isinstance(n, ast.Subscript) and _dotted(n.value) in json_vars and \
                    isinstance(_const(n.slice), str):
                keys.add(_const(n.slice))
        return None, None, reads_body, keys

    def _schema_check(self, mod, fn, imports, depth=0) -> str | None:
        """The api_types struct whose from_json_value the handler (or a helper it calls,
        e.g. api_contract.generate_contract_error) runs on the raw body."""
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            f = _dotted(n.func) or ""
            if f.endswith(".from_json_value"):
                owner = f.rsplit(".", 1)[0]
                imp = imports.get(owner.split(".")[0])
                if imp and imp[0] == "sglang.api.v1.api_types":
                    return imp[1] if "." not in owner else _last(owner)
            elif depth < 2 and isinstance(n.func, ast.Name):
                imp = imports.get(n.func.id)
                if imp and imp[1] and imp[0].startswith("sglang.srt.entrypoints"):
                    helper_mod = self._module(imp[0])
                    helper = helper_mod.functions.get(imp[1]) if helper_mod else None
                    if helper is not None:
                        got = self._schema_check(helper_mod, helper,
                                                 helper_mod.local_imports(helper), depth + 1)
                        if got:
                            return got
        return None

    @staticmethod
    def _always_error(fn) -> int | None:
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and
                                           isinstance(s.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], ast.Raise) and \
                isinstance(body[0].exc, ast.Call) and \
                _last(_dotted(body[0].exc.func)) == "HTTPException":
            code = _kw(body[0].exc, "status_code")
            if code is None and body[0].exc.args:
                code = body[0].exc.args[0]
            v = _const(code)
            return v if isinstance(v, int) else -1
        return None


@functools.lru_cache(maxsize=None)
def contract(version: str) -> Contract:
    """Contract(version), parsed once per process (a parse takes ~2 s)."""
    return Contract(version)
