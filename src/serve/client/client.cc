// The client's public facades: Client, RemoteWeights, RemoteHostWeights.
// The machinery is in client_connect.cc, client_mux.cc, client_reclaim.cc,
// client_leases.cc, client_keeper.cc, client_mapping.cc and client_fork.cc
// (design note: client_internal.h).
#include "client_internal.h"

namespace modelcache::serve {

// ------------------------------------------------------- RemoteWeights ----

RemoteWeights& RemoteWeights::operator=(RemoteWeights&& other) noexcept {
  if (this != &other) {
    Release();
    grant_ = std::move(other.grant_);
  }
  return *this;
}

const std::string& RemoteWeights::model() const { return grant_->copy->model; }
uint64_t RemoteWeights::lease() const { return grant_->copy->lease; }
const std::string& RemoteWeights::load() const { return grant_->load; }
const std::vector<weights::WeightSet>& RemoteWeights::files() const {
  return grant_->copy->files;
}
const std::vector<RemoteTensor>& RemoteWeights::tensors() const {
  return grant_->copy->tensors;
}
uint64_t RemoteWeights::data_bytes() const { return grant_->copy->data_bytes; }

const RemoteTensor* RemoteWeights::Find(std::string_view name) const {
  // Each file's header has an index of its own.
  for (size_t i = 0; i < grant_->copy->files.size(); ++i) {
    const weights::WeightSet& file = grant_->copy->files[i];
    if (const weights::TensorInfo* t = file.header().Find(name)) {
      return &grant_->copy
                  ->tensors[grant_->copy->first_tensor[i] +
                            static_cast<size_t>(t - file.tensors().data())];
    }
  }
  return nullptr;
}

std::span<const std::byte> RemoteWeights::data(std::string_view name) const {
  const RemoteTensor* t = Find(name);
  if (t == nullptr) {
    throw Error(ErrorCode::kNotFound, "model '" + grant_->copy->model +
                                          "' has no tensor named '" +
                                          base::Printable(name) + "'");
  }
  return t->data;
}

void RemoteWeights::Release() { grant_.reset(); }

std::vector<weights::HostWeights> RemoteWeights::ShareAsHostWeights() const {
  std::vector<weights::HostWeights> out;
  out.reserve(grant_->copy->files.size());
  for (const weights::WeightSet& file : grant_->copy->files) {
    out.emplace_back(std::shared_ptr<const weights::WeightSet>(grant_, &file));
  }
  return out;
}

// -------------------------------------------------------------- Client ----

Client::Client(std::shared_ptr<detail::ClientCore> core)
    : core_(std::move(core)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;

Client::~Client() = default;

Client Client::Connect(const std::string& socket_path, ClientOptions options) {
  auto core = std::make_shared<detail::ClientCore>(socket_path, options);
  core->Connected(detail::After(options.connect_timeout), nullptr);
  return Client(std::move(core));
}

detail::ClientCore& Client::Core() {
  if (core_->generation() != detail::g_fork_generation.load()) {
    // A forked child: the parent's core may hold a lock no thread here will
    // release. Leave it (leaked on purpose) and start afresh.
    const std::string path = core_->path();
    const ClientOptions options = core_->options();
    new std::shared_ptr<detail::ClientCore>(std::move(core_));
    core_ = std::make_shared<detail::ClientCore>(path, options);
  }
  return *core_;
}

RemoteWeights Client::Acquire(std::string_view model,
                              const RemoteAcquireOptions& options) {
  return Core().Acquire(model, options);
}

std::optional<RemoteWeights> Client::AcquireLocal(std::string_view model) {
  return Core().AcquireLocal(model);
}

RemoteWeights Client::Acquire(std::string_view model,
                              std::chrono::milliseconds timeout) {
  RemoteAcquireOptions options;
  options.timeout = timeout;
  return Acquire(model, options);
}

void Client::Ping(std::chrono::milliseconds timeout) { Core().Ping(timeout); }

ServerInfo Client::Info() {
  return Core()
      .Connected(detail::After(std::chrono::seconds(5)), nullptr)
      ->info;
}

void Client::Close() { Core().Close(); }

const std::string& Client::socket_path() const { return core_->path(); }

size_t Client::IdleLeases() { return Core().IdleLeases(); }

ReclaimStats Client::Reclaims() { return Core().Reclaims(); }

// ---------------------------------------------------- RemoteHostWeights ----

RemoteHostWeights::RemoteHostWeights(Client client,
                                     RemoteAcquireOptions defaults)
    : client_(std::move(client)), defaults_(std::move(defaults)) {}

std::vector<weights::HostWeights> RemoteHostWeights::AcquireModel(
    const std::string& model, const std::vector<std::string>&,
    const AcquireOptions& options) {
  RemoteAcquireOptions remote = defaults_;
  if (options.deadline != Clock::time_point::max()) {
    remote.timeout =
        std::max(std::chrono::milliseconds(0),
                 std::chrono::duration_cast<std::chrono::milliseconds>(
                     options.deadline - Clock::now()));
  }
  remote.when_full = options.when_full;
  if (options.interrupt.check) remote.interrupt = options.interrupt;
  return client_.Acquire(model, remote).ShareAsHostWeights();
}

}  // namespace modelcache::serve
