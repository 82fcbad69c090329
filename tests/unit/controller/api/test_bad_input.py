"""Bad input at the API: names that would become file paths or MQTT topic levels, uploads over the size
limit, and bodies of the wrong content type. Each is refused with a 4xx whose detail names the field;
none reaches the database, the artifact store or a topic. On SQLite and PostgreSQL (``fleet``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from tests.support.controller_app import Fleet, FleetFactory
from tests.support.onnx_models import yolov8_like

DEVICE = "bad-in-dev"

# Each would escape a folder, split or widen an MQTT topic, or break a database text column.
BAD_NAMES = [
    "a/b",
    "../etc",
    "..",
    ".hidden",
    "a\\b",
    "nul\x00byte",
    "plus+",
    "hash#",
    "sp ace",
    "-lead",
    "é",
    "x" * 65,
]
BAD_IDS = [pytest.param(n, id=repr(n)[:20]) for n in BAD_NAMES]


def _names_field(r: Any, field: str, value: str = "") -> None:
    if "/" in value and r.status_code == 404 and r.json() == {"detail": "Not Found"}:
        return  # a '/' splits the URL path: no route matches, nothing is looked up
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    detail = r.json().get("detail")
    if isinstance(detail, list):  # a validation error: one of its entries is located at the field
        # (the last name in its location: a list query parameter adds the item's index after it)
        locs = [
            [x for x in d.get("loc", []) if isinstance(x, str)][-1:] for d in detail if isinstance(d, dict)
        ]
        locs = [loc[0] for loc in locs if loc]
        assert field in locs, f"the error does not name {field!r}: {r.text}"
    else:  # the controller's own error: a sentence that names the field
        assert isinstance(detail, str) and field in detail, f"the error does not name {field!r}: {r.text}"


def _enroll(fleet: Fleet) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": DEVICE})
    assert r.status_code in (200, 201), r.text


def _nothing_published(fleet: Fleet, name: str) -> None:
    assert not any(name in p.topic for p in fleet.transport.published), "a bad name reached a topic"


# --------------------------------------------------------------------------- device ids


@pytest.mark.parametrize("bad", BAD_IDS)
def test_device_ids_that_are_not_one_topic_level_are_refused(fleet: Fleet, bad: str) -> None:
    r = fleet.client.post("/api/v1/devices", json={"id": bad})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][-1] == "id", r.text
    # In a path, too: a clear 4xx naming the parameter, never a lookup or a topic.
    path = quote(bad, safe="")
    for method, url, body in [
        ("GET", f"/api/v1/devices/{path}", None),
        ("PUT", f"/api/v1/devices/{path}/labels", {"labels": {}}),
        ("PUT", f"/api/v1/devices/{path}/cameras/cam1/model", {"model": "tiny", "version": "1"}),
        ("DELETE", f"/api/v1/devices/{path}/cameras/cam1/model", None),
    ]:
        r = fleet.client.request(method, url, json=body)
        if bad == ".." and r.status_code == 404:
            continue  # ".." is resolved by the URL itself
        _names_field(r, "device_id", bad)
    _nothing_published(fleet, bad)


@pytest.mark.parametrize("field", ["name", "labels"])
def test_device_name_and_labels_with_nul_or_separators_are_refused(fleet: Fleet, field: str) -> None:
    body: dict[str, Any] = {"id": DEVICE}
    body[field] = "dev\x00ice" if field == "name" else {"site": "a\x00b"}
    r = fleet.client.post("/api/v1/devices", json=body)
    _names_field(r, field)
    if field == "labels":
        r = fleet.client.post("/api/v1/devices", json={"id": DEVICE, "labels": {"a b/../c": "x"}})
        _names_field(r, "labels")


# --------------------------------------------------------------------------- cameras and models


@pytest.mark.parametrize("bad", BAD_IDS)
def test_camera_model_and_version_names_are_refused(fleet: Fleet, bad: str) -> None:
    _enroll(fleet)
    api = fleet.client
    cam = quote(bad, safe="")
    r = api.put(f"/api/v1/devices/{DEVICE}/cameras/{cam}/model", json={"model": "tiny", "version": "1"})
    if not (bad == ".." and r.status_code == 404):
        _names_field(r, "camera", bad)
    for field in ("model", "version"):
        body = {"model": "tiny", "version": "1", field: bad}
        r = api.put(f"/api/v1/devices/{DEVICE}/cameras/cam1/model", json=body)
        _names_field(r, field)
        r = api.post("/api/v1/deployments", json={"name": "d1", **body})
        _names_field(r, field)
    r = api.post("/api/v1/deployments", json={"model": "tiny", "version": "1", "cameras": [{"camera": bad}]})
    _names_field(r, "camera")
    r = api.post("/api/v1/deployments", json={"model": "tiny", "version": "1", "name": bad})
    _names_field(r, "name")
    seg = quote(bad, safe="")
    for url in (f"/api/v1/models/{seg}/versions/1", f"/api/v1/models/tiny/versions/{seg}"):
        for method in ("GET", "DELETE"):
            r = api.request(method, url)
            if bad == ".." and r.status_code == 404:
                continue
            _names_field(r, "name" if "/tiny/" not in url else "version", bad)
    r = api.get("/api/v1/models/tiny/versions/1")
    assert r.status_code == 200, "the registered model is untouched"
    _nothing_published(fleet, bad)


@pytest.mark.parametrize("bad", BAD_IDS)
def test_uploaded_model_names_are_refused_before_anything_is_stored(fleet: Fleet, bad: str) -> None:
    store = fleet.client.app.state.runtime.store
    before = sorted(p.name for p in store.root.rglob("*"))
    for field in ("name", "version"):
        data = {"name": "up", "version": "1", field: bad}
        r = fleet.client.post("/api/v1/models", data=data, files={"file": ("m.onnx", yolov8_like())})
        _names_field(r, field)
    assert sorted(p.name for p in store.root.rglob("*")) == before, "a refused upload left files"
    names = [(m["name"], m["version"]) for m in fleet.client.get("/api/v1/models").json()]
    assert all(n == "tiny" for n, _ in names), names


def test_query_strings_with_nul_are_refused(fleet: Fleet) -> None:
    for url, field in [
        ("/api/v1/detections?device=a%00b", "device"),
        ("/api/v1/detections?label=%00", "label"),
        ("/api/v1/events?kind=%00", "kind"),
        ("/api/v1/events/search?severity=%00", "severity"),
        ("/api/v1/detections?cursor=%00", "cursor"),
    ]:
        _names_field(fleet.client.get(url), field)


# --------------------------------------------------------------------------- uploads over the limit

LIMIT = 256 * 1024


@pytest.fixture
def small_fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet(max_upload_bytes=LIMIT)


def _multipart_head(boundary: str) -> bytes:
    return (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="version"\r\n\r\n1\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="m.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


class CountingBody:
    """An endless upload, 64 KiB at a time, counting what the server pulled from it."""

    def __init__(self, head: bytes, total: int) -> None:
        self.head, self.total, self.sent = head, total, 0

    def chunks(self) -> Iterator[bytes]:
        yield self.head
        self.sent += len(self.head)
        while self.sent < self.total:
            self.sent += 65536
            yield b"\x08" * 65536


def _asgi_upload(fleet: Fleet, body: CountingBody, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """POST the body straight into the ASGI app, one chunk per receive(), as a server would stream it."""
    app = fleet.client.app
    auth = [
        (k.lower().encode(), v.encode())
        for k, v in fleet.client.headers.items()
        if k.lower() == "authorization"
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/v1/models",
        "raw_path": b"/api/v1/models",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *auth, *headers],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "state": {},
    }
    chunks = body.chunks()
    status: list[int] = []
    out: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if status:  # answered: the client would see the response and stop sending
            return {"type": "http.disconnect"}
        try:
            return {"type": "http.request", "body": next(chunks), "more_body": True}
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            out.append(message.get("body", b""))

    asyncio.run(app(scope, receive, send))
    return status[0], b"".join(out)


def test_an_upload_over_the_limit_is_refused_without_reading_it_all(small_fleet: Fleet) -> None:
    boundary = "bOuNdArY"
    ctype = (b"content-type", f"multipart/form-data; boundary={boundary}".encode())
    total = 200 * 2**20  # 200 MiB that never has to exist anywhere

    # Declared too large: refused before a byte of the body is read.
    body = CountingBody(_multipart_head(boundary), total)
    code, text = _asgi_upload(small_fleet, body, [ctype, (b"content-length", str(total).encode())])
    assert code == 413 and b"limit" in text, text
    assert body.sent == 0, f"{body.sent} bytes read of a body declared too large"

    # Streamed (chunked, no length): refused once the limit is passed, the rest never pulled.
    body = CountingBody(_multipart_head(boundary), total)
    code, text = _asgi_upload(small_fleet, body, [ctype, (b"transfer-encoding", b"chunked")])
    assert code == 413 and b"limit" in text, text
    assert body.sent < LIMIT + 4 * 65536, f"{body.sent} bytes pulled for a limit of {LIMIT}"
    assert small_fleet.client.get("/api/v1/models").status_code == 200


def test_oversized_form_fields_are_refused(small_fleet: Fleet) -> None:
    r = small_fleet.client.post(
        "/api/v1/models",
        data={"name": "m", "version": "1", "manifest": "x" * (2 * 2**20)},
        files={"file": ("m.onnx", b"\x08" * 10)},
    )
    assert r.status_code == 413 and "manifest" in r.text, r.text


# --------------------------------------------------------------------------- content types


def test_model_upload_in_the_wrong_content_type_is_refused(fleet: Fleet) -> None:
    api = fleet.client
    for kwargs in (
        {"json": {"name": "m", "version": "1", "file": "AAAA"}},
        {"content": b"\x08\x01", "headers": {"content-type": "application/octet-stream"}},
        {"content": b"name=m&version=1", "headers": {"content-type": "application/x-www-form-urlencoded"}},
        {"content": b"--x\r\n", "headers": {"content-type": "multipart/form-data"}},  # no boundary
        {"content": b"garbage", "headers": {"content-type": "multipart/form-data; boundary=zz"}},
    ):
        r = api.post("/api/v1/models", **kwargs)  # type: ignore[arg-type]
        assert 400 <= r.status_code < 500 and r.status_code != 404, (kwargs, r.status_code, r.text)
        assert "multipart" in r.text or "file" in r.text, r.text


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("POST", "/api/v1/devices", {"id": DEVICE}),
        ("PUT", f"/api/v1/devices/{DEVICE}/labels", {"labels": {"a": "b"}}),
        ("PUT", f"/api/v1/devices/{DEVICE}/cameras/cam1/model", {"model": "tiny", "version": "1"}),
        ("POST", "/api/v1/deployments", {"model": "tiny", "version": "1"}),
    ],
)
def test_json_routes_refuse_text_and_form_bodies(fleet: Fleet, method: str, url: str, body: Any) -> None:
    _enroll(fleet)
    api = fleet.client
    for kwargs in (
        {"content": json.dumps(body).encode(), "headers": {"content-type": "text/plain"}},
        {"data": {k: json.dumps(v) for k, v in body.items()}},
        {"content": b"\xff\xfe{", "headers": {"content-type": "application/json"}},
        {"content": b"", "headers": {"content-type": "application/json"}},
        {"content": b"[1, 2]", "headers": {"content-type": "application/json"}},
        {"content": b"{" * 50_000, "headers": {"content-type": "application/json"}},
    ):
        r = api.request(method, url, **kwargs)  # type: ignore[arg-type]
        if r.status_code == 400:  # FastAPI's answer to bytes that are not text at all
            assert "parsing the body" in r.text, r.text[:300]
            continue
        assert r.status_code == 422, (kwargs, r.status_code, r.text[:300])
        assert r.json()["detail"][0]["loc"][0] == "body", r.text[:300]


# --------------------------------------------------------------------------- model resource limits


def test_a_sparse_initializer_declaring_exabytes_is_refused_with_the_numbers(fleet: Fleet) -> None:
    """A few-KB file whose sparse tensor is 2^62 floats once dense."""
    from tests.support.onnx_models import with_sparse_bomb

    bomb = with_sparse_bomb()
    assert len(bomb) < 10_000
    r = fleet.client.post(
        "/api/v1/models", data={"name": "bomb", "version": "1"}, files={"file": ("m.onnx", bomb)}
    )
    assert r.status_code == 413, r.text
    dense = 4 * 2**62 + 6 * 3 * 8 * 8 * 4 + 3 * 8  # the bomb, the model's conv weight and shape
    limit = 2 * 1024**3
    assert f"take {dense} bytes when dense" in r.text and f"limit of {limit} bytes" in r.text, r.text
    assert "bomb" in r.text, "the error names the largest tensor"
    assert fleet.client.get("/api/v1/models/bomb/versions/1").status_code == 404


def test_the_dense_size_cap_is_a_setting_and_counts_dense_weights(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(max_model_dense_bytes=4096, build_variants_on_upload=False)
    model = yolov8_like()  # a 6x3x8x8 float weight: 4608 bytes, plus 24 bytes of shape
    r = fleet.client.post(
        "/api/v1/models", data={"name": "w", "version": "1"}, files={"file": ("m.onnx", model)}
    )
    assert r.status_code == 413 and "take 4632 bytes" in r.text and "limit of 4096 bytes" in r.text, r.text
    fleet = make_fleet(max_model_dense_bytes=4632, build_variants_on_upload=False)
    r = fleet.client.post(
        "/api/v1/models", data={"name": "w", "version": "1"}, files={"file": ("m.onnx", model)}
    )
    assert r.status_code == 201, r.text  # at the cap is allowed


def _manifest_for_yolov8_like(width: int, height: int) -> str:
    return json.dumps(
        {
            "decoder": "yolov8",
            "input": {
                "name": "images",
                "layout": "NCHW",
                "dtype": "float32",
                "color": "RGB",
                "width": width,
                "height": height,
            },
            "outputs": ["output0"],
            "labels": ["a", "b"],
            "decoder_params": {"pad": "x" * 2000},
        }
    )


def test_a_manifest_input_size_that_contradicts_the_static_graph_is_refused(make_fleet: FleetFactory) -> None:
    """A manifest saying 8192x8192 for a 64x64 model."""
    fleet = make_fleet(build_variants_on_upload=False)
    for width, height, named in [
        (8192, 8192, "width 8192 (the model's is 64) and height 8192"),
        (64, 32, "height 32"),
    ]:
        r = fleet.client.post(
            "/api/v1/models",
            data={
                "name": "huge-input",
                "version": f"{width}x{height}",
                "manifest": _manifest_for_yolov8_like(width, height),
            },
            files={"file": ("m.onnx", yolov8_like(size=64))},
        )
        assert r.status_code == 400, r.text
        assert named in r.text and "[1, 3, 64, 64]" in r.text, r.text
    r = fleet.client.post(
        "/api/v1/models",
        data={"name": "huge-input", "version": "ok", "manifest": _manifest_for_yolov8_like(64, 64)},
        files={"file": ("m.onnx", yolov8_like(size=64))},
    )
    assert r.status_code == 201, r.text
