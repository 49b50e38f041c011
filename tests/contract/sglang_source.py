"""SGLang contract kit: check HTTP requests against SGLang's own source, per pinned version.

SGLang's source comes from its PyPI wheel, downloaded once per release and cached
(tests/contract/sglang_wheel.py, whose names this module re-exports: ``PINNED``,
``source_dir``, ``model_fields``...).

What ``check_request(version, method, path, body, query)`` checks, reading that source:

* routes: every ``@app.get/post/put/delete/patch/head/websocket/api_route`` decorator in
  ``http_server.py`` (``if`` blocks included; ``api_route`` without ``methods`` is GET; a path
  from ``os.environ.get(NAME, DEFAULT)`` is DEFAULT; a path held in a variable, such as
  ``SGLANG_OLLAMA_ROOT_ROUTE``'s, is skipped), plus the routes of routers passed to
  ``app.include_router`` (their modules are extracted too). ``{x}`` / ``{x:path}`` match.
* bodies: the handler's body parameter (``obj: X`` or ``Annotated[X, Body()]``, read with
  ``ast``) names the class, which must be one of ``ROUTE_BODIES`` (else ``ContractKitError``).
  The class definitions (and the aliases/classes they use) are cut out of ``io_struct.py`` and
  executed with real ``msgspec``/``typing``/``pydantic``, with SGLang's own
  ``msgspec_utils.py`` and ``field_validators.py``; names imported from other modules (torch,
  multimodal types, ``schedule_batch`` enums...) become ``typing.Any``, so fields typed with
  them accept anything (asyncrl sends none of them). Methods are dropped except
  ``__get_pydantic_core_schema__``, so ``__post_init__`` does not run.
* validation semantics: exactly the server's. FastAPI parses the body with orjson and calls
  ``TypeAdapter(X).validate_python(body)``; msgspec Structs validate through SGLang's
  ``msgspec_struct_pydantic_core_schema`` (a typed dict, unknown keys ignored). So this is
  pydantic *lax python mode* after a JSON round trip: "5" -> int and 5 -> float pass, 5 -> str
  and a list -> str fail, required fields must be present. Unknown keys, which the server
  drops silently, are reported because a field we believe we set would be lost.
* ``/generate``: ``GenerateReqInput`` (a dataclass) the same way, and every key of
  ``sampling_params`` (dict or list of dicts) must be an argument of ``SamplingParams(...)``
  (its ``__init__`` or, for a Struct/dataclass, its fields): an unknown one is a TypeError,
  HTTP 400. From 0.5.22 the route also runs its contract gate (:func:`generate_contract`): the
  generated schema decoder, executed from the wheel, types every field and sampling value
  (``max_new_tokens: 16.0`` is a 400 there); before, sampling values are not type-checked
  (the constructor does not either).
* query parameters: scalar handler parameters (``timeout: float = Query(0.0, ge=0.0)``) with
  their type and ge/gt/le/lt bounds; unknown query keys are reported.

Not checked: semantics inside handlers and the tokenizer manager ("input_ids must not be
empty", ``SamplingParams.verify``), auth, headers, response bodies, server flags.
"""

from __future__ import annotations
import __future__

import ast
import copy
import dataclasses
import functools
import importlib
import json
import re
import sys
import types
import typing
from pathlib import Path

import msgspec
import pydantic

from tests.contract.sglang_wheel import (  # noqa: F401 (the kit's public names are these too)
    API_TYPES,
    EXECUTED_MODULES,
    FUNCTION_CALL_PARSER,
    HTTP_SERVER,
    IO_STRUCT,
    PINNED,
    SAMPLING_PARAMS,
    SERVER_ARGS,
    SUPPORTED_RELEASES,
    WEIGHT_CHECKER,
    SGLangSourceError,
    behaviour_facts,
    cache_dir,
    included_routers,
    is_name,
    model_fields,
    module_file,
    requires_dist,
    source_dir,
    static_str,
)

ROUTE_BODIES = {
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/generate": "GenerateReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
}
_HTTP_METHODS = {"get", "post", "put", "delete", "patch", "head", "options", "trace"}
_NOT_PARAMS = {"Request", "Response", "WebSocket", "BackgroundTasks", "UploadFile"}
_SCALARS = {"str": str, "int": int, "float": float, "bool": bool}


class ContractKitError(RuntimeError):
    """The kit cannot model this request (extend ROUTE_BODIES / the kit)."""


# ---- routes and handlers (ast over http_server.py and included routers) ----------------------

@dataclasses.dataclass(frozen=True)
class Handler:
    """What a route's handler takes: body class names (``Optional[X]`` bodies may be left out),
    query parameters (name -> (TypeAdapter, required)), and whether it reads the raw Request."""
    function: str
    body: tuple[str, ...]
    body_required: bool
    query: dict[str, tuple[pydantic.TypeAdapter, bool]]
    raw_request: bool


def _route_decorators(tree: ast.Module, owner: str, prefix: str):
    """Yield (method, path, handler function) for each route decorator on ``owner``."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn in sorted(functions, key=lambda n: n.lineno):  # source order: the first one registered wins
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and is_name(dec.func.value, owner)):
                continue
            kind, kw = dec.func.attr, {k.arg: k.value for k in dec.keywords}
            path = static_str(dec.args[0] if dec.args else kw.get("path"))
            if path is None:
                continue
            if kind in _HTTP_METHODS:
                methods = [kind.upper()]
            elif kind == "websocket":
                methods = ["WEBSOCKET"]
            elif kind == "api_route":
                methods = [m.upper() for m in ast.literal_eval(kw["methods"])] if "methods" in kw else ["GET"]
            else:
                continue
            for method in methods:
                yield method, prefix + path, fn


def _handler(fn: ast.FunctionDef | ast.AsyncFunctionDef, path: str) -> Handler:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.posonlyargs + fn.args.args) - len(fn.args.defaults))
    defaults += fn.args.defaults + fn.args.kw_defaults
    body, required, query, raw = [], False, {}, False
    for arg, default in zip(args, defaults):
        ann, marker = arg.annotation, default
        if isinstance(ann, ast.Subscript) and is_name(ann.value, "Annotated"):
            ann, *markers = ann.slice.elts
            marker = markers[0] if markers else default
        kind = ast.unparse(marker.func) if isinstance(marker, ast.Call) else None
        if isinstance(ann, ast.Subscript) and is_name(ann.value, "Optional"):
            ann = ann.slice
        elif isinstance(ann, ast.BinOp) and is_name(ann.right, "None"):
            ann = ann.left
        name = ann.id if isinstance(ann, ast.Name) else getattr(ann, "attr", None)
        name = ast.unparse(ann) if name is None and ann is not None else name  # List[X] etc.: a body
        if name in _NOT_PARAMS or "{" + arg.arg in path or kind in ("Depends", "Header", "Cookie", "Path", "Form", "File"):
            raw = raw or name == "Request"
        elif kind == "Query" or name in _SCALARS or name is None:
            query[arg.arg] = (_query_adapter(name, marker if kind == "Query" else None), default is None)
        else:
            body.append(name)
            required = required or default is None
    return Handler(fn.name, tuple(body), required, query, raw)


def _query_adapter(name: str | None, query_call: ast.Call | None) -> pydantic.TypeAdapter:
    bounds = {k.arg: ast.literal_eval(k.value) for k in (query_call.keywords if query_call else [])
              if k.arg in ("ge", "gt", "le", "lt")}
    return pydantic.TypeAdapter(typing.Annotated[_SCALARS.get(name, typing.Any), pydantic.Field(**bounds)])


@functools.cache
def handlers(version: str) -> dict[tuple[str, str], Handler]:
    """(METHOD, path template) -> Handler for every route of sglang==version."""
    src = source_dir(version)
    server = ast.parse((src / HTTP_SERVER).read_text(), HTTP_SERVER)
    trees = [(server, "app", "")]
    for module, name, prefix in included_routers(server):
        file = module_file(module, {str(p.relative_to(src)) for p in src.rglob("*.py")})
        tree = ast.parse((src / file).read_text(), file)
        own = next((static_str(k.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and any(is_name(t, name) for t in n.targets) and isinstance(n.value, ast.Call)
                    for k in n.value.keywords if k.arg == "prefix"), None)
        trees.append((tree, name, prefix + (own or "")))
    found: dict[tuple[str, str], Handler] = {}
    for tree, owner, prefix in trees:
        for method, path, fn in _route_decorators(tree, owner, prefix):
            found.setdefault((method, path), _handler(fn, path))
    return found


def routes(version: str) -> set[tuple[str, str]]:
    """The (METHOD, path) pairs served by sglang==version's HTTP server."""
    return set(handlers(version))


def _match(version: str, method: str, path: str) -> Handler | None:
    for (m, template), handler in handlers(version).items():
        pattern = re.sub(r"\\\{(\w+)(:path)?\\\}", lambda g: ".+" if g[2] else "[^/]+", re.escape(template))
        if m == method and re.fullmatch(pattern, path):
            return handler
    return None


# ---- request classes, executed from io_struct.py -------------------------------------------

def _top_level(tree: ast.Module):
    """Module statements, with ``if``/``try`` blocks flattened (first definition wins)."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.If, ast.Try)):
            yield from _top_level(ast.Module(body=stmt.body + stmt.orelse, type_ignores=[]))
        else:
            yield stmt


def _pruned(stmt: ast.stmt) -> ast.stmt:
    """A class without its methods, except the pydantic hook that decides validation."""
    if not isinstance(stmt, ast.ClassDef):
        return stmt
    body = [s for s in stmt.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
            or s.name == "__get_pydantic_core_schema__"]
    pruned = copy.copy(stmt)
    pruned.body = body or [ast.copy_location(ast.Pass(), stmt)]
    return pruned


def _free_names(stmt: ast.stmt) -> set[str]:
    names = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # a quoted forward reference (harmless if it is just a string)
    return names


def _exec(modname: str, file: Path, body: list[ast.stmt], bindings: dict) -> types.ModuleType:
    """Execute SGLang's own statements (from the pinned PyPI wheel) as module ``modname``."""
    module = types.ModuleType(modname)
    module.__dict__.update(bindings)
    sys.modules[modname] = module  # msgspec and pydantic resolve string annotations through it
    code = compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), str(file), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, module.__dict__)  # noqa: S102 - SGLang's source, read from its pinned wheel
    return module


@functools.cache
def _executed_module(version: str, module: str) -> types.ModuleType:
    file = source_dir(version) / (module.replace(".", "/") + ".py")
    return _exec(f"{_prefix(version)}.{module}", file, ast.parse(file.read_text(), str(file)).body, {})


def _prefix(version: str) -> str:
    return "_sglang_contract_" + version.replace(".", "_")


def _import(version: str, module: str | None, attr: str | None):
    """Bind an import of io_struct: real for stdlib/msgspec/pydantic, SGLang's own code for the
    EXECUTED_MODULES, ``typing.Any`` for anything else (torch, multimodal types, ...)."""
    if module in EXECUTED_MODULES:
        mod = _executed_module(version, module)
        return getattr(mod, attr) if attr else mod
    if module and (module.split(".")[0] in sys.stdlib_module_names
                   or module.split(".")[0] in ("msgspec", "pydantic", "pydantic_core", "typing_extensions")):
        mod = importlib.import_module(module)
        return getattr(mod, attr) if attr else mod
    return typing.Any


@functools.cache
def request_classes(version: str) -> dict[str, type]:
    """ROUTE_BODIES' classes (and BaseReq) that exist in sglang==version, by name."""
    file = source_dir(version) / IO_STRUCT
    tree = ast.parse(file.read_text(), str(file))
    defs, imports = {}, {}
    for stmt in _top_level(tree):
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef)):
            defs.setdefault(stmt.name, stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
                if isinstance(target, ast.Name):
                    defs.setdefault(target.id, stmt)
        elif isinstance(stmt, ast.ImportFrom) and stmt.module != "__future__":
            for a in stmt.names:
                imports.setdefault(a.asname or a.name, (stmt.module, a.name))
        elif isinstance(stmt, ast.Import):
            for a in stmt.names:
                imports.setdefault(a.asname or a.name.split(".")[0], (a.name if a.asname else a.name.split(".")[0], None))
    wanted = [n for n in ["BaseReq", *ROUTE_BODIES.values()] if n in defs]
    selected, bindings, todo, seen = {}, {}, list(wanted), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in defs:
            stmt = defs[name]
            selected[id(stmt)] = _pruned(stmt)
            todo.extend(_free_names(selected[id(stmt)]))
        elif name in imports:
            bindings[name] = _import(version, *imports[name])
    body = sorted(selected.values(), key=lambda s: s.lineno)
    module = _exec(f"{_prefix(version)}.io_struct", file, body, bindings)
    return {name: getattr(module, name) for name in wanted}


@functools.cache
def sampling_param_names(version: str) -> frozenset[str]:
    """The keyword arguments ``SamplingParams(**sampling_params)`` accepts in sglang==version."""
    tree = ast.parse((source_dir(version) / SAMPLING_PARAMS).read_text())
    classes = {n.name: n for n in _top_level(tree) if isinstance(n, ast.ClassDef)}

    def accepted(cls: ast.ClassDef) -> set[str]:
        init = next((s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if init is not None:
            return {a.arg for a in init.args.args[1:] + init.args.kwonlyargs}
        names = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                 and "ClassVar" not in ast.unparse(s.annotation)}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                names |= accepted(classes[base.id])
        return names

    return frozenset(accepted(classes["SamplingParams"]))


# ---- checking a request ---------------------------------------------------------------------

def _fields(cls: type) -> dict[str, str]:
    """Field name -> annotation text as written in SGLang's source."""
    names = ([f.name for f in msgspec.structs.fields(cls)] if issubclass(cls, msgspec.Struct)
             else [f.name for f in dataclasses.fields(cls) if f.init])
    annotations = {k: v for c in reversed(cls.__mro__) for k, v in getattr(c, "__annotations__", {}).items()}
    return {name: str(annotations.get(name, "?")) for name in names}


@functools.cache
def _adapter(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def _body_problems(version: str, cls: type, body: object) -> list[str]:
    where = f"{cls.__name__} in sglang {version}"
    try:
        body = json.loads(json.dumps(body))
    except (TypeError, ValueError) as exc:
        return [f"body is not JSON-serializable: {exc}"]
    if not isinstance(body, dict):
        return [f"body must be a JSON object for {where}, got {type(body).__name__}"]
    fields = _fields(cls)
    problems = [f"field {k} is not a field of {where} (it would be ignored)" for k in body if k not in fields]
    try:
        _adapter(cls).validate_python(body, from_attributes=True)
    except pydantic.ValidationError as exc:
        by_field: dict[str, list[dict]] = {}
        for err in exc.errors(include_url=False):
            # Struct errors carry union-branch labels in loc (SGLang's python schema is
            # is-instance | dict->struct); the is-instance branch never matches a JSON dict.
            name = next((str(x) for x in err["loc"] if x in fields), None)
            if name or err["type"] != "is_instance_of":
                by_field.setdefault(name or "<body>", []).append(err)
        for name, errs in by_field.items():
            if any(e["type"] == "missing" for e in errs):
                problems.append(f"field {name} is required by {where} but missing")
            else:
                problems.append(f"field {name}={body.get(name)!r} is not a valid {fields.get(name, '?')} "
                                f"for {where}: {errs[0]['msg']}")
    return problems


@functools.cache
def generate_contract(version: str):
    """The /generate contract gate of sglang==version, or None where it has none: 0.5.22+
    refuse (HTTP 400, ``{"error": <text>}``) a body that ``GenerateRequest.from_json_value`` of
    the generated ``sglang/api/v1/api_types.py`` rejects (``entrypoints/api_contract.py``), also
    values the dataclass parse admits (``max_new_tokens: 16.0``, an unknown sampling key). Read
    from the source: the module must exist and ``http_server.py`` must call the gate. Returns
    ``f(body) -> error text or None`` running that module's own decoder."""
    src = source_dir(version)
    if not (src / API_TYPES).exists() or "generate_contract_error(" not in (src / HTTP_SERVER).read_text():
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_sglang_api_types_{version.replace('.', '_')}", src / API_TYPES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the Structs' annotations through it
    spec.loader.exec_module(module)

    def check(body: object) -> str | None:
        try:
            module.GenerateRequest.from_json_value(body)
        except module.JsonContractError as exc:
            return str(exc)
        return None
    return check


def check_request(version: str, method: str, path: str, body: object = None,
                  query: dict[str, object] | None = None) -> list[str]:
    """The problems a real sglang==version server would have with this request (empty: fine).

    ``body`` None means no body; ``query`` maps query parameters to values (sent as strings).
    Raises ContractKitError when the route's body class is one the kit does not model."""
    method = method.upper()
    handler = _match(version, method, path)
    if handler is None:
        return [f"no route {method} {path} in sglang {version}"]
    problems = []
    for key, value in (query or {}).items():
        if key not in handler.query:
            problems.append(f"query parameter {key} is not taken by {method} {path} in sglang {version} (it would be ignored)")
            continue
        try:
            handler.query[key][0].validate_python(str(value).lower() if isinstance(value, bool) else str(value))
        except pydantic.ValidationError as exc:
            problems.append(f"query parameter {key}={value!r} is rejected by sglang {version}: {exc.errors()[0]['msg']}")
    problems += [f"query parameter {k} is required by {method} {path} in sglang {version}"
                 for k, (_, required) in handler.query.items() if required and k not in (query or {})]
    if not handler.body:
        if body is not None and not handler.raw_request:
            problems.append(f"{method} {path} takes no body in sglang {version} (it would be ignored)")
        return problems
    if len(handler.body) > 1 or handler.body[0] not in ROUTE_BODIES.values():
        raise ContractKitError(f"{method} {path} in sglang {version} takes {handler.body}: not modelled by the kit")
    if body is None:
        missing = f"{method} {path} requires a JSON body ({handler.body[0]}) in sglang {version}"
        return problems + [missing] * handler.body_required
    cls = request_classes(version)[handler.body[0]]
    problems += _body_problems(version, cls, body)
    if cls.__name__ == "GenerateReqInput" and isinstance(body, dict):
        params = body.get("sampling_params")
        accepted = sampling_param_names(version)
        for item in [p for p in (params if isinstance(params, list) else [params]) if isinstance(p, dict)]:
            problems += [f"sampling param {k} is not an argument of SamplingParams in sglang {version} "
                         f"(TypeError, HTTP 400)" for k in item if k not in accepted]
        gate = generate_contract(version)
        error = None if gate is None else gate(json.loads(json.dumps(body)))  # what the server parsed
        if error is not None:
            problems.append(f"the /generate contract gate of sglang {version} refuses the body (HTTP 400): {error}")
    return problems
