"""`python -m env_server NAME --port P`: serve one environment over HTTP (waitress, threaded).

`python -m env_server NAME -h` lists that environment's own flags as well."""

import argparse
import logging
import os
import signal
import sys
import threading
import time

from . import get_env_class, served_envs
from .app import create_app, make_server


def bounded(kind: type, lo: float, hi: float):
    """An argparse type: a `kind` in [lo, hi]. A value outside is refused in argparse's one line
    naming the flag (exit 2), where it would fail later in a traceback or silently (the OS picks a
    port for 99999; 2**64 threads never start)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: "
                                             f"{text!r}") from None
        if not lo <= v <= hi:  # (a NaN fails too)
            raise argparse.ArgumentTypeError(f"{text} is outside [{lo}, {hi}]")
        return v
    return parse


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m env_server", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    names = served_envs()
    p.add_argument("name", choices=names, help="which environment to serve; `python -m env_server "
                                              "NAME -h` also lists that environment's own flags")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 127.0.0.1 serves this machine only (and refuses "
                        "cross-site and DNS-rebinding requests); on any other address whoever "
                        "reaches the port may use it")
    p.add_argument("--port", type=bounded(int, 0, 65535), default=36001,
                   help="port (0 picks a free one and prints it)")
    p.add_argument("--threads", type=bounded(int, 1, 1024), default=4,
                   help="worker threads serving requests (more for games that wait on I/O or a "
                        "JVM)")
    p.add_argument("--max-instances", type=bounded(int, 1, 2 ** 31), default=1024,
                   help="cap on live instances (503 past it)")
    p.add_argument("--idle-timeout", type=bounded(float, 0, 10 ** 7), default=900.0,
                   help="close instances idle for this many seconds (0: never)")
    p.add_argument("--max-body-kb", type=bounded(int, 1, 2 ** 30), default=1024,
                   help="largest request body accepted (413 past it)")
    p.add_argument("--op-timeout", type=bounded(float, 1e-3, 10 ** 7), default=60.0,
                   help="seconds a call into a game may take (not counting its wait for an "
                        "instance another call is using: a 503 busy past this long); past it the "
                        "caller gets a 504 and the instance is marked hung (its thread is "
                        "abandoned), the rest of the server keeps serving")
    p.add_argument("--parent-pid", type=bounded(int, 1, 2 ** 31 - 1), default=None,
                   help="exit when this process is gone (set by launchers such as train.py)")
    # before parsing, so --help lists its flags
    name = argv[0] if argv and argv[0] in names else None
    env_cls = get_env_class(name) if name else None
    if env_cls is not None:
        env_cls.add_args(p.add_argument_group(f"{name} options"))
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        world = env_cls.load_world(args)
    except (OSError, ValueError) as e:
        p.error(f"cannot load {name}: {e}")
    app = create_app(env_cls, world, max_instances=args.max_instances,
                     idle_timeout_s=args.idle_timeout, op_timeout_s=args.op_timeout,
                     max_body_bytes=args.max_body_kb * 1024, host=args.host)
    try:
        server = make_server(app, args.host, args.port, threads=args.threads)
    except OSError as e:  # the port is taken, or the address is not this machine's
        app.extensions["registry"].stop()
        sys.exit(f"python -m env_server: cannot listen on {args.host}:{args.port}: "
                 f"{e.strerror or e} (another server on that port? pick another with --port, or 0 "
                 "for a free one)")
    except ValueError as e:  # waitress: an address that is no address (999.1.1.1)
        app.extensions["registry"].stop()
        sys.exit(f"python -m env_server: cannot listen on {args.host}:{args.port}: {e} (give "
                 "another --host)")
    # This exact line is how launchers learn the port when --port 0 was asked for.
    print(f"serving {name} on http://{args.host}:{server.effective_port}", flush=True)
    # SIGTERM (what launchers send) unwinds like Ctrl-C, so instances (JVMs, browsers) get closed.
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)

    def watch_parent():
        while os.getppid() == args.parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    try:  # (the watcher inside: a parent already gone stops the server at once, quietly)
        if args.parent_pid is not None:  # an orphan would hold its port and JVMs forever
            threading.Thread(target=watch_parent, daemon=True).start()
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        app.extensions["registry"].stop()


if __name__ == "__main__":
    main()
