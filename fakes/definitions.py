"""Checks requests and answers against a provider's official OpenAPI document, the copies vendored
as test data in `tests/provider-definitions/` (Fly's Machines `openapi.json`, E2B's control-plane
`openapi.yml` and envd `envd.yaml`).  The fakes call it on every request they receive and every
answer they give; what it returns becomes a *violation*, which the Rust contract suites and the
black-box tests require to be empty.  So a field our client invents, misnames or mistypes fails
the tests even where the fake itself would have accepted it, and so does a fake answer the real
service could never give.

Strict on purpose: an object property the document does not declare is a failure, unless the
schema says `additionalProperties`; in a request, so is one it marks deprecated.  OpenAPI 3.0's `nullable` is honoured.  A query parameter
the operation does not declare is a failure.  Answers are checked only for statuses the
operation documents with a JSON schema (an undocumented status, e.g. 412 on many Fly calls, is
left alone and listed by `undocumented()` instead).

Needs `jsonschema` (and `PyYAML` for E2B's YAML files), which `scripts/setup-test-env.sh`
installs into both test venvs.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT4

ROOT = Path(__file__).resolve().parent.parent / "tests" / "provider-definitions"
URI = "urn:provider-definition"


def _nullable(node):
    """OpenAPI 3.0 `nullable: true` as JSON Schema (`type: [T, "null"]`), and local `$ref`s made
    absolute, recursively."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if isinstance(out.get("$ref"), str) and out["$ref"].startswith("#/"):
        # Absolute, so a schema taken out of the document still reaches its references.
        out["$ref"] = URI + out["$ref"]
    if out.pop("nullable", False) is True:
        if "$ref" in out or "allOf" in out or "oneOf" in out or "anyOf" in out:
            return {"anyOf": [out, {"type": "null"}]}
        if "type" in out:
            out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else out["type"] + ["null"]
        if "enum" in out and None not in out["enum"]:
            out["enum"] = out["enum"] + [None]
    return out


class Definition:
    """One OpenAPI document: operations by method and path template, and schema checks."""

    def __init__(self, relative: str, document: dict | None = None):
        """The document at `tests/provider-definitions/<relative>`, or `document` under that
        name (an OpenAPI document a fake assembles, e.g. from a CRD's schema)."""
        if document is None:
            path = ROOT / relative
            text = path.read_text()
            if path.suffix in (".yml", ".yaml"):
                import yaml  # E2B's documents and the Kubernetes CRDs are YAML

                document = yaml.safe_load(text)
            else:
                document = json.loads(text)
        self.name = relative
        self.document = _nullable(document)
        self.registry = Registry().with_resource(
            URI, Resource.from_contents(self.document, default_specification=DRAFT4))
        self.operations = []
        for template, item in self.document.get("paths", {}).items():
            shared = item.get("parameters", [])
            regex = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
            for method, operation in item.items():
                if method in ("parameters", "summary", "description", "servers"):
                    continue
                parameters = [self.resolve(p) for p in shared + operation.get("parameters", [])]
                self.operations.append((method.upper(), template, regex, operation, parameters))
        # Literal templates before ones with placeholders, so /sandboxes/{id} never hides a
        # literal sibling.
        self.operations.sort(key=lambda op: op[1].count("{"))
        self.lock = threading.Lock()
        self.undocumented_statuses: set[str] = set()

    def resolve(self, node):
        seen = 0
        while isinstance(node, dict) and "$ref" in node:
            ref = node["$ref"].removeprefix(URI)
            if not ref.startswith("#/"):
                raise ValueError(f"{self.name}: external $ref {ref} is not supported")
            node = self.document
            for part in ref[2:].split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            seen += 1
            if seen > 32:
                raise ValueError(f"{self.name}: $ref loop at {ref}")
        return node

    def operation(self, method: str, path: str):
        for op_method, template, regex, operation, parameters in self.operations:
            if op_method == method and regex.match(path):
                return template, operation, parameters
        return None

    # -- schema checks ------------------------------------------------------------------------
    def errors(self, schema, instance, where: str, deprecations: bool = True) -> list[str]:
        """Everything wrong with `instance` under `schema`: JSON Schema errors, then properties
        the schema does not declare."""
        validator = jsonschema.Draft4Validator(schema, registry=self.registry)
        found = [f"{where}{_at(e.absolute_path)}: {e.message}"
                 for e in sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))]
        found += self.unknown(schema, instance, where, deprecations)
        return found

    def properties(self, schema) -> tuple[dict, object]:
        """Declared properties of a schema (through $ref and allOf/anyOf/oneOf), and its
        `additionalProperties` (None when it allows nothing undeclared)."""
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return {}, True
        props: dict[str, list] = {}
        extra = schema.get("additionalProperties")
        if extra is False:
            extra = None
        if schema.get("x-kubernetes-preserve-unknown-fields") is True:
            extra = True  # a CRD's schema keeps what it does not describe here
        for name, sub in (schema.get("properties") or {}).items():
            props.setdefault(name, []).append(sub)
        for key in ("allOf", "anyOf", "oneOf"):
            for member in schema.get(key) or []:
                member_props, member_extra = self.properties(member)
                for name, subs in member_props.items():
                    props.setdefault(name, []).extend(subs)
                if member_extra is not None and extra is None:
                    extra = member_extra
        declares_object = "properties" in schema or any(k in schema for k in ("allOf", "anyOf", "oneOf"))
        if not declares_object and extra is None:
            extra = True  # a free-form object (`type: object` alone) allows anything
        return props, extra

    def unknown(self, schema, instance, where: str, deprecations: bool = True) -> list[str]:
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return []
        found: list[str] = []
        if isinstance(instance, list):
            items = schema.get("items")
            if items is not None:
                for i, item in enumerate(instance):
                    found += self.unknown(items, item, f"{where}[{i}]", deprecations)
            for key in ("anyOf", "oneOf", "allOf"):
                for member in schema.get(key) or []:
                    if self.resolve(member).get("type") == "array":
                        found += self.unknown(member, instance, where, deprecations)
            return found
        if not isinstance(instance, dict):
            return []
        props, extra = self.properties(schema)
        for name, value in instance.items():
            if name in props:
                for sub in props[name]:
                    if deprecations and _deprecated(self.resolve(sub)):
                        found.append(f"{where}.{name}: deprecated by the official definition")
                    found += self.unknown(sub, value, f"{where}.{name}", deprecations)
            elif extra is None:
                found.append(f"{where}.{name}: not declared by the official definition")
            elif isinstance(extra, dict):
                found += self.unknown(extra, value, f"{where}.{name}", deprecations)
        return found

    # -- what the fakes call ------------------------------------------------------------------
    def check_request(self, method: str, path: str, query: dict, body, extra_query=(),
                      content_type: str | None = None) -> list[str]:
        """Violations of one request: unknown operation, undeclared or deprecated query
        parameters, a body that does not match the operation's request schema (strictly).
        `extra_query` names parameters the provider's own client sends that its definition
        does not declare (each one is listed in docs/testing.md). `content_type`, when given,
        must be one the operation declares (Kubernetes' PATCH takes only its patch types)."""
        found = self.operation(method, path)
        if found is None:
            return [f"{method} {path}: no such operation in {self.name}"]
        template, operation, parameters = found
        where = f"{method} {template}"
        problems = []
        declared = {p.get("name"): p for p in parameters if p.get("in") == "query"}
        for name in query:
            if name in extra_query:
                continue
            if name not in declared:
                problems.append(f"{where}: query parameter {name!r} is not declared by the official definition")
            elif _deprecated(declared[name]):
                problems.append(f"{where}: query parameter {name!r} is deprecated: {declared[name].get('description')}")
        content = (operation.get("requestBody") or {}).get("content") or {}
        if content_type is not None and body is not None and content and "*/*" not in content:
            if content_type not in content:
                problems.append(f"{where}: content type {content_type!r} is not one the official definition declares "
                                f"({', '.join(sorted(content))})")
            schema = (content.get(content_type) or {}).get("schema")
        else:
            # Kubernetes declares its bodies under `*/*` (it takes JSON, YAML and protobuf).
            schema = (content.get("application/json") or content.get("*/*") or {}).get("schema")
        if body is not None:
            if schema is None:
                problems.append(f"{where}: the official definition declares no JSON body")
            else:
                problems += self.errors(schema, body, f"{where} body")
        elif schema is not None and (operation.get("requestBody") or {}).get("required"):
            problems.append(f"{where}: the official definition requires a body")
        return problems

    def check_answer(self, method: str, path: str, status: int, payload) -> list[str]:
        """Violations of one answer of the fake: a body that does not match the schema the
        operation documents for that status."""
        found = self.operation(method, path)
        if found is None:
            return []
        template, operation, _ = found
        responses = operation.get("responses") or {}
        response = responses.get(str(status)) or responses.get("default")
        if response is None:
            with self.lock:
                self.undocumented_statuses.add(f"{method} {template} {status}")
            return []
        response = self.resolve(response)
        schema = ((response.get("content") or {}).get("application/json") or {}).get("schema")
        if schema is None or payload is None:
            return []
        # Answers may carry deprecated fields: the real service still sends them.
        return self.errors(schema, payload, f"answer {status} to {method} {template}", deprecations=False)

    def undocumented(self) -> list[str]:
        with self.lock:
            return sorted(self.undocumented_statuses)


def _deprecated(node) -> bool:
    """`deprecated: true`, or a description that says so (Fly's converted document marks its
    deprecated aliases only in prose, e.g. `instance_id`: "(deprecated; use version)")."""
    if not isinstance(node, dict):
        return False
    return node.get("deprecated") is True or "deprecated" in str(node.get("description", "")).lower()


def _at(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


_CACHE: dict[str, Definition] = {}
_CACHE_LOCK = threading.Lock()


def load(relative: str) -> Definition:
    """The document at `tests/provider-definitions/<relative>`, parsed once per process."""
    with _CACHE_LOCK:
        if relative not in _CACHE:
            _CACHE[relative] = Definition(relative)
        return _CACHE[relative]


# -- protobuf definitions, for the Connect calls with the JSON codec ------------------------------

_SCALARS = {
    "string": (str,), "bytes": (str,), "bool": (bool,),
    "int32": (int,), "uint32": (int,), "sint32": (int,), "fixed32": (int,), "sfixed32": (int,),
    "int64": (int, str), "uint64": (int, str), "sint64": (int, str), "fixed64": (int, str),
    "sfixed64": (int, str), "float": (int, float, str), "double": (int, float, str),
}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


class Proto:
    """The messages, enums and RPCs of one `.proto` file (proto3, no imports needed), enough to
    check proto3-JSON bodies strictly: unknown fields, wrong JSON types, unknown enum names."""

    def __init__(self, relative: str):
        text = (ROOT / relative).read_text()
        text = re.sub(r"//[^\n]*", "", text)
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        self.name = relative
        self.tokens = re.findall(r"[A-Za-z_][\w.]*|\d+|\S", text)
        self.pos = 0
        self.package = ""
        self.messages: dict[str, dict] = {}  # full name -> {json name: (label, type, scope)}
        self.enums: dict[str, set] = {}
        self.rpcs: dict[str, tuple[str, str]] = {}  # "Service/Method" -> (input, output)
        self._parse_file()

    # parsing ------------------------------------------------------------------------------------
    def _next(self) -> str:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def _skip_statement(self) -> None:
        depth = 0
        while True:
            token = self._next()
            if token == "{":
                depth += 1
            elif token == "}":
                depth -= 1
                if depth == 0:
                    return
            elif token == ";" and depth == 0:
                return

    def _parse_file(self) -> None:
        while self.pos < len(self.tokens):
            token = self._next()
            if token == "package":
                self.package = self._next()
                self._next()
            elif token == "message":
                self._message(self.package)
            elif token == "enum":
                self._enum(self.package)
            elif token == "service":
                self._service()
            elif token in ("syntax", "import", "option"):
                self.pos -= 1
                self._skip_statement()

    def _message(self, scope: str) -> None:
        full = f"{scope}.{self._next()}"
        fields: dict[str, tuple] = {}
        self.messages[full] = fields
        assert self._next() == "{"
        self._body(full, fields)

    def _body(self, full: str, fields: dict) -> None:
        while True:
            token = self._next()
            if token == "}":
                return
            if token == "message":
                self._message(full)
            elif token == "enum":
                self._enum(full)
            elif token == "oneof":
                self._next()
                assert self._next() == "{"
                self._body(full, fields)
            elif token in ("reserved", "option", "extensions"):
                self.pos -= 1
                self._skip_statement()
            elif token == ";":
                continue
            else:
                label = "single"
                if token in ("repeated", "optional"):
                    label, token = token, self._next()
                if token == "map":
                    assert self._next() == "<"
                    self._next()
                    assert self._next() == ","
                    value = self._next()
                    assert self._next() == ">"
                    label, kind = "map", value
                else:
                    kind = token
                name = self._next()
                self.pos -= 1
                self._skip_statement()
                fields[_camel(name)] = (label, kind, full)
                fields.setdefault(name, (label, kind, full))

    def _enum(self, scope: str) -> None:
        full = f"{scope}.{self._next()}"
        assert self._next() == "{"
        values = set()
        while True:
            token = self._next()
            if token == "}":
                break
            if token == "option" or token == "reserved":
                self.pos -= 1
                self._skip_statement()
                continue
            values.add(token)
            self.pos -= 1
            self._skip_statement()
        self.enums[full] = values

    def _service(self) -> None:
        service = self._next()
        assert self._next() == "{"
        while True:
            token = self._next()
            if token == "}":
                return
            if token != "rpc":
                self.pos -= 1
                self._skip_statement()
                continue
            method = self._next()
            assert self._next() == "("
            request = self._next()
            if request == "stream":
                request = self._next()
            while self._next() != "returns":
                pass
            assert self._next() == "("
            response = self._next()
            if response == "stream":
                response = self._next()
            self._skip_statement()
            # Resolved when checked: the messages may come later in the file.
            self.rpcs[f"{service}/{method}"] = (request, response)

    def _resolve(self, kind: str, scope: str) -> str:
        """A type name as seen from `scope`: the innermost enclosing scope that declares it."""
        parts = scope.split(".")
        while True:
            candidate = ".".join(parts + [kind]) if parts else kind
            if candidate in self.messages or candidate in self.enums:
                return candidate
            if not parts:
                return kind
            parts.pop()

    # checking -----------------------------------------------------------------------------------
    def check(self, message: str, instance, where: str) -> list[str]:
        """Everything wrong with a proto3-JSON `instance` of `message` (a full name)."""
        fields = self.messages.get(message)
        if fields is None:
            return [f"{where}: no message {message} in {self.name}"]
        if not isinstance(instance, dict):
            return [f"{where}: {message} must be a JSON object"]
        found = []
        for key, value in instance.items():
            if key not in fields:
                found.append(f"{where}.{key}: not a field of {message} in {self.name}")
                continue
            label, kind, scope = fields[key]
            if value is None:
                continue
            if label == "repeated":
                if not isinstance(value, list):
                    found.append(f"{where}.{key}: repeated field must be an array")
                    continue
                for i, item in enumerate(value):
                    found += self._value(kind, scope, item, f"{where}.{key}[{i}]")
            elif label == "map":
                if not isinstance(value, dict):
                    found.append(f"{where}.{key}: map field must be an object")
                    continue
                for k, item in value.items():
                    found += self._value(kind, scope, item, f"{where}.{key}[{k!r}]")
            else:
                found += self._value(kind, scope, value, f"{where}.{key}")
        return found

    def _value(self, kind: str, scope: str, value, where: str) -> list[str]:
        if kind.startswith("google.protobuf."):
            # Well-known types: Timestamp and Duration are strings in proto3-JSON.
            if kind in ("google.protobuf.Timestamp", "google.protobuf.Duration") and not isinstance(value, str):
                return [f"{where}: {kind} must be a string"]
            return []
        if kind in _SCALARS:
            allowed = _SCALARS[kind]
            if isinstance(value, bool) and bool not in allowed:
                return [f"{where}: {kind} must not be a boolean"]
            return [] if isinstance(value, allowed) else [f"{where}: not a valid {kind}"]
        resolved = self._resolve(kind, scope)
        if resolved in self.enums:
            if isinstance(value, int) and not isinstance(value, bool):
                return []
            return [] if value in self.enums[resolved] else [f"{where}: {value!r} is not a value of {resolved}"]
        return self.check(resolved, value, where)

    def check_request(self, rpc: str, body) -> list[str]:
        """`rpc` is "Service/Method"."""
        if rpc not in self.rpcs:
            return [f"{rpc}: no such RPC in {self.name}"]
        return self.check(self._resolve(self.rpcs[rpc][0], self.package), body, f"{rpc} request")

    def check_answer(self, rpc: str, body) -> list[str]:
        if rpc not in self.rpcs:
            return []
        return self.check(self._resolve(self.rpcs[rpc][1], self.package), body, f"{rpc} answer")


_PROTOS: dict[str, Proto] = {}


def proto(relative: str) -> Proto:
    """The `.proto` file at `tests/provider-definitions/<relative>`, parsed once per process."""
    with _CACHE_LOCK:
        if relative not in _PROTOS:
            _PROTOS[relative] = Proto(relative)
        return _PROTOS[relative]
