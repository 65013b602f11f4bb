"""A local container registry for pull tests: no registry is reachable from the test machines.

It speaks the read side of the Docker Registry HTTP API v2 (`GET /v2/`, manifests and blobs by
tag or digest, schema 2 manifests, gzip layers), which is all an engine needs to pull. It serves
one image taken from the local engine with `GET /images/{name}/get` (the `docker save` tarball:
both the classic layout and the OCI layout of newer engines carry `manifest.json`).

Engines treat 127.0.0.0/8 as an insecure registry by default, so `127.0.0.1:<port>/<repo>:<tag>`
pulls over plain HTTP without any daemon setting.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote

from testkit.engine import Engine

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _single_file_tar(name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


class Registry:
    """`with Registry(engine, "sandbox-busybox:full", "kiln/pull", "v1") as reg: reg.image`"""

    def __init__(self, engine: Engine, source_image: str, repository: str, tag: str, fresh_layer_bytes: int = 0):
        """`fresh_layer_bytes`: add a layer of that many random bytes, which no engine has yet,
        so a pull really downloads and extracts something (the source image's own layers are
        already on the engine and would only be reported as "Already exists")."""
        self.repository = repository
        self.tag = tag
        self.blobs: dict[str, bytes] = {}
        self.requests: list[str] = []
        saved = engine.ok("GET", f"/images/{quote(source_image, safe='')}/get")
        with tarfile.open(fileobj=io.BytesIO(saved)) as tar:
            (entry,) = json.loads(tar.extractfile("manifest.json").read())
            config = tar.extractfile(entry["Config"]).read()
            layers = [tar.extractfile(path).read() for path in entry["Layers"]]
        if fresh_layer_bytes:
            layers.append(_single_file_tar("kiln-pull-fresh-layer", os.urandom(fresh_layer_bytes)))
            image_config = json.loads(config)
            image_config["rootfs"]["diff_ids"].append(_digest(layers[-1]))
            image_config.setdefault("history", []).append({"created_by": "testkit.registry fresh layer"})
            config = json.dumps(image_config).encode()
        layer_refs = []
        for layer in layers:
            # The saved layers are plain tars; the image config's diff_ids name them uncompressed,
            # and the manifest names what is served (gzip), as a real registry does.
            packed = gzip.compress(layer, compresslevel=1)
            self.blobs[_digest(packed)] = packed
            layer_refs.append({"mediaType": LAYER_GZIP, "size": len(packed), "digest": _digest(packed)})
        self.blobs[_digest(config)] = config
        self.manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_V2,
                "config": {"mediaType": CONFIG_V1, "size": len(config), "digest": _digest(config)},
                "layers": layer_refs,
            }
        ).encode()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]
        self.image = f"127.0.0.1:{self.port}/{repository}:{tag}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Registry":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def _handler(self):
        registry = self
        route = re.compile(r"^/v2/(?P<name>.+)/(?P<kind>manifests|blobs)/(?P<ref>[^/]+)$")

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _send(self, status: int, body: bytes, content_type: str, digest: str | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                if digest:
                    self.send_header("Docker-Content-Digest", digest)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _unknown(self, code: str) -> None:
                body = json.dumps({"errors": [{"code": code, "message": code.lower().replace("_", " ")}]}).encode()
                self._send(404, body, "application/json")

            def do_GET(self) -> None:
                registry.requests.append(f"{self.command} {self.path}")
                if self.path in ("/v2", "/v2/"):
                    return self._send(200, b"{}", "application/json")
                match = route.match(self.path)
                if not match or match["name"] != registry.repository:
                    return self._unknown("NAME_UNKNOWN")
                ref = match["ref"]
                if match["kind"] == "manifests":
                    if ref in (registry.tag, _digest(registry.manifest)):
                        return self._send(200, registry.manifest, MANIFEST_V2, _digest(registry.manifest))
                    return self._unknown("MANIFEST_UNKNOWN")
                blob = registry.blobs.get(ref)
                if blob is None:
                    return self._unknown("BLOB_UNKNOWN")
                return self._send(200, blob, "application/octet-stream", ref)

            do_HEAD = do_GET

        return Handler
