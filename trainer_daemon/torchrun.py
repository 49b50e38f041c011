"""``python -m trainer_daemon.torchrun [torchrun arguments]``: torchrun, with its rendezvous
store bound to the master address (127.0.0.1 when that is loopback), never every interface.

Measured (torch 2.13, ``--rdzv-backend static``, the default when ``--master-addr`` is given):
torchrun's agent hosts the rendezvous ``TCPStore`` that the workers also use
(``TORCHELASTIC_USE_AGENT_STORE``), and it listens on ``::`` — every interface — whatever
``--master-addr`` says; ``--standalone`` and ``--rdzv-backend c10d`` do the same (plus a second
store). torchrun has no option to change that. This wrapper swaps the ``static`` rendezvous
handler for one that, on node 0, hands the store a socket bound to the master address
(``master_listen_fd``; :func:`asyncrl.listen.reserve_listen_socket`: 127.0.0.1 for a loopback
master, else the address itself, and a master address that is not this node's is an error
naming it; issue 48); everything else is torchrun's own ``main``. Other nodes connect as usual.

The swap touches torchrun's handler registry (``rendezvous_handler_registry._registry``), a
private attribute: the public ``register`` refuses to replace ``static``. If a future PyTorch
changes it, this module raises at start rather than silently listening everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def _install_bound_static() -> None:
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as st
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousInfo,
        RendezvousStoreInfo,
        rendezvous_handler_registry,
    )

    from asyncrl.listen import is_loopback, reserve_listen_socket

    class BoundStaticRendezvous(st.StaticTCPRendezvous):
        """``StaticTCPRendezvous`` whose node-0 store listens on the master address only."""

        def next_rendezvous(self) -> RendezvousInfo:
            if self.rank != 0:
                return super().next_rendezvous()
            if not self._store:
                sock = reserve_listen_socket(self.master_addr, self.master_port)
                host = "127.0.0.1" if is_loopback(self.master_addr) else self.master_addr
                self._store = TCPStore(host, self.master_port, self.world_size, True, self.timeout,
                                       multi_tenant=True, master_listen_fd=sock.fileno())
                sock.detach()  # the store owns the fd now
            return RendezvousInfo(PrefixStore(self.run_id, self._store), self.rank, self.world_size,
                                  RendezvousStoreInfo(self.master_addr, self.master_port))

    def create(params):
        base = st.create_rdzv_handler(params)
        return BoundStaticRendezvous(base.master_addr, base.master_port, base.rank, base.world_size,
                                        base.run_id, int(base.timeout.total_seconds()))

    registry = getattr(rendezvous_handler_registry, "_registry", None)
    if not isinstance(registry, dict) or "static" not in registry:
        raise RuntimeError("this PyTorch's torchrun handler registry changed; use plain torchrun (store on all interfaces)")
    registry["static"] = create


def main(argv: Sequence[str] | None = None) -> None:
    _install_bound_static()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
