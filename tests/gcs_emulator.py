"""A real local Cloud Storage server for tests: `gcp-storage-emulator` on 127.0.0.1 at a free port.

Import the fixture into a test module that needs it (`from gcs_emulator import gcs_emulator  # noqa:
F401`). One server per test session, in memory, with the bucket `test-bucket`; the fixture sets
`TENSORSTORE_GCS_HTTP_URL` (tensorstore's `gcs` kvstore, used for every gs:// byte in smelt_jax.data)
and `STORAGE_EMULATOR_HOST` (google-cloud-storage, gcsfs) to it, and restores both afterwards.
Child processes (multiprocessing, subprocess) inherit the variables. Skips when the emulator is not
installed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from http import HTTPStatus

import pytest

BUCKET = "test-bucket"
_VARIABLES = ("TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _send_generations(server_module) -> None:
    """Real Cloud Storage answers every media download with the object's `x-goog-generation` and
    `x-goog-metageneration` headers; this emulator leaves them out, and tensorstore (orbax's OCDBT
    manifest commits) then reads a malformed generation. The emulator's download handler is wrapped
    to send them, from the emulator's own object metadata; everything else is the emulator as it is."""
    from gcp_storage_emulator.handlers import objects

    original = objects.download
    if getattr(original, "sends_generations", False):
        return

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # noqa: BLE001 - the emulator's own handler answers a missing object
            obj = None
        if obj is not None:
            response["x-goog-generation"] = str(obj.get("generation") or "1")
            response["x-goog-metageneration"] = str(obj.get("metageneration") or "1")
        return original(request, response, storage, *args, **kwargs)

    download.sends_generations = True
    objects.download = download  # `objects.get` (JSON API, alt=media) calls it by this name
    _route(server_module, original, download)


def _route(server_module, original, replacement) -> None:
    for _, handlers in server_module.HANDLERS:  # the routes hold the function itself
        for method, handler in list(handlers.items()):
            if handler is original:
                handlers[method] = replacement


def _honour_preconditions(server_module) -> None:
    """Real Cloud Storage refuses an upload or a delete whose `ifGenerationMatch` is not the object's
    generation (0: the object must not exist) with 412; this emulator ignores the parameter. Its
    insert and delete handlers are wrapped to check it first, under one lock so that check and write
    are atomic, as on the real service (the trainer's lease on gs:// relies on it)."""
    from gcp_storage_emulator.handlers import objects

    if getattr(objects.insert, "honours_preconditions", False):
        return
    guard = threading.Lock()

    def current_generation(storage, bucket: str, name: str) -> str:
        try:
            return str(storage.get_file_obj(bucket, name).get("generation") or "0")
        except Exception:  # noqa: BLE001 - the emulator raises its own NotFound
            return "0"

    def conditional(original, name_of):
        def handler(request, response, storage, *args, **kwargs):
            wanted = request.query.get("ifGenerationMatch")
            with guard:
                if wanted and wanted[0] != current_generation(storage, request.params["bucket_name"],
                                                              name_of(request)):
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    return None
                return original(request, response, storage, *args, **kwargs)

        handler.honours_preconditions = True
        return handler

    for attr, name_of in (("insert", lambda r: (r.query.get("name") or [""])[0]),
                          ("delete", lambda r: r.params["object_id"])):
        original = getattr(objects, attr)
        replacement = conditional(original, name_of)
        setattr(objects, attr, replacement)
        _route(server_module, original, replacement)


@pytest.fixture(scope="session")
def gcs_emulator():
    """The emulator's base URL (http://127.0.0.1:PORT); gs://test-bucket/ exists and is empty."""
    server_module = pytest.importorskip("gcp_storage_emulator.server")
    from smelt_jax.platform import storage as gcs

    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # a 404 is not an error here
    _send_generations(server_module)
    _honour_preconditions(server_module)
    port = _free_port()
    server = server_module.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    previous = {name: os.environ.get(name) for name in _VARIABLES}
    for name in _VARIABLES:
        os.environ[name] = url
    gcs._bucket.cache_clear()  # kvstores opened before the variable was set point elsewhere
    try:
        yield url
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        gcs._bucket.cache_clear()
        server.stop()
