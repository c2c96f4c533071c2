// Which IPv4 address a rank of the TCP transport listens on, and the text form in which
// ranks publish theirs.
//
// Every rank with peers listens on one IPv4 address: 127.0.0.1 when all its peers share
// its host, else PYCOMM_SOCKET_IFNAME's address, else the first up non-loopback
// interface's. It publishes "addr:port" (tcp_mesh.cc says where and when).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>

#include <optional>
#include <string>

#include "transport/transport.h"

namespace pycomm {
namespace tcp {

// The one address this rank listens on (see above); throws InvalidArgument for a
// PYCOMM_SOCKET_IFNAME that names no interface or address, or one that is down.
in_addr listen_address(const TransportSetup& s);

// "a.b.c.d".
std::string ipv4_text(const in_addr& a);

// Parses "a.b.c.d:port" as published by a peer.
std::optional<sockaddr_in> parse_address(const std::string& text);

}  // namespace tcp
}  // namespace pycomm
