"""``radixserve keys``: CurveZMQ key pairs for the fleet's ZeroMQ sockets.

- ``keys new BASE``: a new key pair in ``BASE.key_secret`` (mode 0600; ``--zmq-key``) and its
  public key in ``BASE.key`` (for other processes' ``--zmq-allow``); never overwrites.
- ``keys new --env``: the same pair as ``RADIXSERVE_ZMQ_KEY=...`` on stdout, no file (for an
  environment file or a secret store).
- ``keys show FILE``: the public key in a key file, and a KV transfer endpoint's form with it.
"""

from __future__ import annotations

import argparse
import sys

from radixserve.links.keys import KEY_ENV, CurveKeys, LinkKeyError, read_allowed, write_key_files


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keys",
        help="make CurveZMQ key pairs for the KV-event and KV-transfer sockets",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
    )
    actions = p.add_subparsers(dest="action", required=True)
    new = actions.add_parser("new", help="a new key pair: BASE.key_secret and BASE.key")
    new.add_argument("base", nargs="?", help="path and name, without extension")
    new.add_argument(
        "--env", action="store_true", help=f"print {KEY_ENV}=SECRET instead of writing files"
    )
    show = actions.add_parser("show", help="the public key in a key file")
    show.add_argument("file", help="a .key or .key_secret file")
    p.set_defaults(func=cmd_keys, parser=p)


def cmd_keys(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.action == "show":
        try:
            [public] = read_allowed(args.file)
        except (LinkKeyError, ValueError) as e:
            parser.error(str(e))
        print(public.decode())
        print(f"a KV transfer endpoint with it: tcp://HOST:PORT?curve={public.decode()}",
              file=sys.stderr)  # fmt: skip
        return 0
    keys = CurveKeys.generate()
    if args.env:
        if args.base:
            parser.error("give BASE or --env, not both")
        print(f"{KEY_ENV}={keys.secret_key.decode()}")
        return 0
    if not args.base:
        parser.error("keys new: give BASE (files BASE.key_secret and BASE.key) or --env")
    try:
        public, secret = write_key_files(keys, args.base)
    except FileExistsError as e:
        parser.error(f"{e.filename} exists already; keys are never overwritten")
    except OSError as e:
        parser.error(f"cannot write {e.filename}: {e.strerror}")
    print(f"{secret}: the key pair (--zmq-key; keep it private)")
    print(f"{public}: the public key (--zmq-allow on the processes it connects to)")
    print(keys.public_key.decode())
    return 0
