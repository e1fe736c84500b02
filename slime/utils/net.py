"""Network helpers shared by the launcher set-up and the SGLang servers."""
from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from urllib.parse import urlparse

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it). Another process may take it before it is bound:
    `reserved_port` holds it until then."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def reserved_port(host: str = HOST):
    """A free TCP port, held while the block runs: bound but not listening, with SO_REUSEADDR, so the OS hands it to
    no other bind(0) or outgoing connection, while a server started in the block can still listen on it if it sets
    SO_REUSEADDR too (torch's TCPStore, i.e. MASTER_PORT, does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        yield s.getsockname()[1]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_this_machine(host: str) -> bool:
    """`host` names an address of this machine: a socket binds only to a local interface's address. False where
    it does not resolve."""
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
                return True
        except OSError:
            continue
    return False


def url_host(url: str) -> str:
    return urlparse(url).hostname or ""


def address_toward(host: str) -> str:
    """This machine's address on the route to `host`: what a process there can connect back to. A UDP
    socket's connect picks the route without sending anything; a loopback `host` gives 127.0.0.1."""
    if is_loopback(host):
        return HOST
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def local_world_size(world_size: int) -> int:
    """Ranks of the job on this machine: torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's launcher (hostfile
    launches too) LOCAL_SIZE; a process started alone is the whole job."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size)


def single_node(world_size: int) -> bool:
    """Whether every rank of the job runs on this machine."""
    return local_world_size(world_size) == world_size


def node_address(world_size: int) -> str:
    """The address ranks on other nodes reach this one at: 127.0.0.1 for a one-node job, else the address on
    the route to the rendezvous host (MASTER_ADDR), which every node reaches."""
    if single_node(world_size):
        return HOST
    return address_toward(os.environ.get("MASTER_ADDR", HOST))
