"""HTTPS on the server and the router, with certificates a throwaway CA issues (trustme).

One real server (tiny model) serves HTTPS and requires a client certificate from its own
client CA; a real router in front of it serves HTTPS too and reaches it with its CA file and
its client certificate. A caller without the right CA, without a client certificate, or
speaking plain HTTP gets nothing; a router that cannot check the worker's certificate, or
has none of its own to show, refuses to start, saying why.
"""

from __future__ import annotations

import ssl

import httpx
import pytest

from testing.fleet import Proc, start_router, stopping

trustme = pytest.importorskip("trustme")

BODY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Server CA + the worker's and router's certificates; a client CA + the router's."""
    d = tmp_path_factory.mktemp("pki")
    server_ca, client_ca = trustme.CA(), trustme.CA()
    files = {}
    server_ca.cert_pem.write_to_path(d / "server-ca.pem")
    client_ca.cert_pem.write_to_path(d / "client-ca.pem")
    for name, ca in (("server", server_ca), ("client", client_ca)):
        cert = ca.issue_cert("127.0.0.1", "localhost")
        cert.private_key_pem.write_to_path(d / f"{name}.key")
        cert.cert_chain_pems[0].write_to_path(d / f"{name}.pem")
        files[name] = (str(d / f"{name}.pem"), str(d / f"{name}.key"))
    files["server_ca"], files["client_ca"] = str(d / "server-ca.pem"), str(d / "client-ca.pem")
    return files


def trusting(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    """A client context that checks servers against ``ca`` and shows ``cert`` if given."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def tls_flags(pki, client_certs: bool) -> list[str]:
    cert, key = pki["server"]
    flags = ["--ssl-keyfile", key, "--ssl-certfile", cert]
    return flags + (["--ssl-ca-certs", pki["client_ca"]] if client_certs else [])


@pytest.fixture(scope="module")
def worker(tiny_model_dir, pki):
    proc = Proc(
        ["serve", "--model", str(tiny_model_dir), "--port", "0", "--log-level", "warning",
         "--dtype", "float32", "--max-total-tokens", "2048", "--served-model-name", "tiny",
         *tls_flags(pki, client_certs=True)],
        "radixserve listening on",
    )  # fmt: skip
    with stopping(proc.wait(timeout=600)):
        yield proc.url


def test_the_server_speaks_https_to_callers_it_can_check(worker, pki):
    assert worker.startswith("https://127.0.0.1:")
    ok = httpx.Client(verify=trusting(pki["server_ca"], pki["client"]))
    r = ok.post(worker + "/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(worker + "/health", timeout=10)  # the system's CAs do not know ours
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(worker + "/health", verify=trusting(pki["server_ca"]), timeout=10)  # no cert
    with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.get(worker.replace("https://", "http://") + "/health", timeout=10)
    assert ok.get(worker + "/health", timeout=10).status_code == 200  # and it goes on


@pytest.mark.slow  # tens of seconds alone; runs in `make test-all`
def test_the_router_reaches_https_workers_and_serves_https(tiny_model_dir, worker, pki):
    cert, key = pki["client"]
    router = start_router(
        tiny_model_dir, [worker], "--worker-ca-certs", pki["server_ca"], "--worker-cert", cert,
        "--worker-key", key, *tls_flags(pki, client_certs=False),
    )  # fmt: skip
    with stopping(router):
        assert router.url.startswith("https://")
        client = httpx.Client(verify=trusting(pki["server_ca"]))
        r = client.post(router.url + "/v1/completions", json=BODY, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        with pytest.raises(httpx.ConnectError):
            httpx.get(router.url + "/health", verify=ssl.create_default_context(), timeout=10)


@pytest.mark.parametrize("drop", ["--worker-ca-certs", "--worker-cert"])
def test_a_router_that_cannot_check_or_show_a_certificate_refuses_to_start(
    tiny_model_dir, worker, pki, drop
):
    cert, key = pki["client"]
    flags = {"--worker-ca-certs": pki["server_ca"], "--worker-cert": cert, "--worker-key": key}
    flags.pop(drop)
    if drop == "--worker-cert":
        flags.pop("--worker-key")
    args = [x for kv in flags.items() for x in kv]
    with pytest.raises(RuntimeError) as e:
        start_router(tiny_model_dir, [worker], *args)
    assert f"cannot add worker {worker}" in str(e.value)


def test_tls_options_are_checked_at_start(tmp_path, pki, capsys):
    from radixserve.cli import main

    cert, key = pki["server"]
    for args, message in (
        (["--ssl-certfile", cert], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-certfile", cert, "--ssl-keyfile", str(tmp_path / "none")], "cannot read"),
        (["--ssl-certfile", cert, "--ssl-keyfile", pki["client"][1]], "KEY_VALUES_MISMATCH"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["router", "--port", "0", "--worker", "http://127.0.0.1:9", *args])
        assert e.value.code == 2
        assert message in capsys.readouterr().err
