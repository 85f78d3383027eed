"""`accelerate launch`, with torchrun's rendezvous store listening on the main process address only.

    python -m pipeline_rl.launch.trainer_agent --config_file ... --main_process_ip 127.0.0.1 ... -m pipeline_rl.cli train ...

Takes exactly `accelerate launch`'s arguments (pipeline_rl.launch.trainer_cmd builds them). Why it
exists: accelerate runs torchrun in-process, and torchrun's static rendezvous (the one accelerate uses)
creates a TCPStore server whose socket torch binds on every interface (`*:main_process_port`), whatever
`--main_process_ip` says. Anyone who can reach the machine could then read and write the rendezvous
keys of the trainer ranks. Here the agent's store is created the way inference_shim.transfer does it
for the weight plane: we bind the listening socket to the main process address ourselves and hand its
descriptor to the store (`master_listen_fd`); torchrun then finds its store already made and uses it.
The exposure test (tests/integration/test_exposure.py) checks the result with `ss` during a real run.
"""

from __future__ import annotations

import socket
import sys

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import static_tcp_rendezvous


class _BoundStaticRendezvous(static_tcp_rendezvous.StaticTCPRendezvous):
    """torchrun's static rendezvous whose store (on the node of group rank 0) listens on master_addr only."""

    def next_rendezvous(self):
        # `_store` is where the base class keeps its store and creates it only when unset; if a torch
        # release renames it, the store below is still created and the test notices the wildcard.
        if getattr(self, "_store", None) is None and self.rank == 0:
            listener = socket.create_server((self.master_addr, self.master_port), backlog=512)
            self._store = TCPStore(
                self.master_addr,
                self.master_port,
                self.world_size,
                True,
                self.timeout,
                multi_tenant=True,
                master_listen_fd=listener.detach(),  # the store owns the descriptor from here on
                use_libuv=True,
            )
        return super().next_rendezvous()


def main() -> None:
    # create_rdzv_handler looks the class up in its module when torchrun calls it, after this swap.
    static_tcp_rendezvous.StaticTCPRendezvous = _BoundStaticRendezvous
    from accelerate.commands.launch import main as accelerate_main

    sys.argv[0] = "accelerate launch"
    accelerate_main()


if __name__ == "__main__":
    main()
