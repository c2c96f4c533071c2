#include "transport/tcp_addresses.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <sys/socket.h>

#include <algorithm>
#include <memory>

#include "core/error.h"

namespace pycomm {
namespace tcp {

std::string ipv4_text(const in_addr& a) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a, buf, sizeof buf);
  return buf;
}

in_addr listen_address(const TransportSetup& s) {
  in_addr loopback{};
  loopback.s_addr = htonl(INADDR_LOOPBACK);
  if (std::all_of(s.peers.begin(), s.peers.end(), [&](int p) { return s.ranks[p].shares_host_with(s.ranks[s.rank]); }))
    return loopback;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) fail(ErrorKind::Internal, errno_message("pycomm: getifaddrs"));
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, freeifaddrs);
  const std::string& wanted = s.config->socket_ifname;  // an interface name or one of its addresses
  in_addr wanted_address{};
  const bool by_address = inet_pton(AF_INET, wanted.c_str(), &wanted_address) == 1;
  for (const ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    const in_addr a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr;
    if (!wanted.empty()) {
      if (by_address ? a.s_addr != wanted_address.s_addr : wanted != i->ifa_name) continue;
      if (!(i->ifa_flags & IFF_UP))
        fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_SOCKET_IFNAME=" + wanted + ": the interface is down");
      return a;
    }
    if ((i->ifa_flags & IFF_UP) && !(i->ifa_flags & IFF_LOOPBACK)) return a;
  }
  if (!wanted.empty())
    fail(ErrorKind::InvalidArgument, "pycomm: PYCOMM_SOCKET_IFNAME=" + wanted +
                                         ": no network interface of that name with an IPv4 address, nor an "
                                         "interface with that address");
  return loopback;
}

std::optional<sockaddr_in> parse_address(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon + 1 >= text.size() || text.size() - colon > 6) return std::nullopt;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (inet_pton(AF_INET, text.substr(0, colon).c_str(), &a.sin_addr) != 1) return std::nullopt;
  unsigned long port = 0;
  for (size_t i = colon + 1; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return std::nullopt;
    port = port * 10 + static_cast<unsigned long>(text[i] - '0');
  }
  if (port == 0 || port > 65535) return std::nullopt;
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

}  // namespace tcp
}  // namespace pycomm
