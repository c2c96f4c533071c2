// A channel for device memory over a host channel (TCP between hosts): frames are staged
// through device slots of the channel's chunk size, and copied straight between those and
// the host channel's slots, which stay page-locked while this channel lives.
//
// Sending: begin_send() reserves the host slot and hands out the device staging slot;
// end_send() copies the payload into the host slot and publishes it, after which the
// host transport moves it (TCP: its own thread) while the caller goes on with the next
// chunk's device work. Receiving: begin_recv_next() copies the host payload into the device
// staging slot and returns the host slot at once, so the next frame can arrive while the
// caller reduces this one. Algorithms hold one frame per channel and direction, so one
// staging slot per direction suffices.
#include <algorithm>
#include <memory>
#include <vector>

#include "device/device_ops.h"
#include "transport/transport.h"

namespace pycomm {
namespace {

class StagedChannel final : public Channel {
 public:
  StagedChannel(Channel& host, const DeviceOps& ops)
      : host_(host),
        ops_(ops),
        send_slot_(ops.allocate(host.chunk_bytes())),
        recv_slot_(ops.allocate(host.chunk_bytes())) {
    for (const Channel::Memory& m : host.slot_memory()) pinned_.push_back(ops.pin(m.data, m.bytes));
  }

  const PeerInfo& peer_info() const override { return host_.peer_info(); }
  size_t chunk_bytes() const override { return host_.chunk_bytes(); }

  void* begin_send(const Deadline& deadline) override {
    host_send_slot_ = host_.begin_send(deadline);
    return send_slot_.get();
  }
  void end_send(const FrameHeader& header) override {
    ops_.copy(host_send_slot_, send_slot_.get(), header.bytes);
    host_.end_send(header);
  }
  const void* begin_recv_next(FrameHeader& got, const Deadline& deadline) override {
    const void* payload = host_.begin_recv_next(got, deadline);
    ops_.copy(recv_slot_.get(), payload, std::min<size_t>(got.bytes, host_.chunk_bytes()));
    host_.end_recv();
    return recv_slot_.get();
  }
  void end_recv() override {}
  std::optional<FrameHeader> peek_recv() override { return host_.peek_recv(); }

 private:
  Channel& host_;
  const DeviceOps& ops_;
  std::shared_ptr<char> send_slot_, recv_slot_;
  std::vector<std::shared_ptr<void>> pinned_;  // the host channel's slots, page-locked
  void* host_send_slot_ = nullptr;
};

}  // namespace

std::unique_ptr<Channel> make_staged_channel(Channel& host, const DeviceOps& ops) {
  return std::make_unique<StagedChannel>(host, ops);
}

}  // namespace pycomm
