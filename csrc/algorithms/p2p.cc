// Point-to-point send and recv: the buffer as a sequence of chunk frames on the pair's
// channel, stamped with the pair's own send/recv count and the tag, so a recv matched
// with the wrong send (tag, size, dtype) is reported rather than silently accepted.
// A send completes once its last frame is in a slot (at most pipeline_depth frames are
// buffered); larger messages wait for the receiver. Transports: any.
#include "algorithms/algorithm.h"

namespace pycomm {

void p2p_send(const Context& cx, const Request& rq) {
  send_bytes(cx, rq.root, rq.input, rq.count * element_size(rq.dtype));
}

void p2p_recv(const Context& cx, const Request& rq) {
  Context as_sent = cx;  // frames carry the sender's stamp
  as_sent.stamp.collective = static_cast<uint8_t>(Collective::Send);
  recv_bytes(as_sent, rq.root, rq.output, rq.count * element_size(rq.dtype));
}

}  // namespace pycomm
