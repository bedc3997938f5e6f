"""Fleet flags: bad values end with an error naming the flag, before anything starts."""

import pytest

from radixserve.cli import main
from radixserve.fleet.dp_launch import child_argv


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "--kv-events-endpoint", "bogus"], "--kv-events-endpoint must look like"),
        (
            ["serve", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"],
            "needs --kv-events-endpoint",
        ),
        (["serve", "--kv-events-block-size", "7", "--page-size", "2"], "--kv-events-block-size"),
        (["serve", "--dp", "0"], "--dp must be at least 1"),
        (["serve", "--step-trace", "t.jsonl", "--dp", "2"], "cannot be combined with --dp"),
        (["router", "--gate-ratio", "0.5"], "--gate-ratio must be >= 1"),
        (["router", "--candidates", "0"], "--candidates must be a positive integer"),
        (["router", "--policy", "random"], "invalid choice"),
        (["router", "--salt-from-api-key", "--api-key", "a"], "needs --worker-api-key"),
        (["router", "--first-byte-timeout", "0"], "--first-byte-timeout must be > 0"),
        (["router", "--max-request-bytes", "12x"], "--max-request-bytes: cannot read"),
    ],
)
def test_bad_fleet_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_dp_children_get_the_parent_flags_but_not_its_placement():
    argv = ["--model", "m", "--dp", "4", "--port=9", "--host", "0.0.0.0", "--gate-tokens", "5"]
    argv += ["--router-policy", "round-robin", "--max-total-tokens", "100", "--page-size=16"]
    argv += ["--admin-key", "the-routers"]
    assert child_argv(argv) == ["--model", "m", "--max-total-tokens", "100", "--page-size=16"]
