// epick-extproc: a native front-end worker for Envoy's ext_proc ([server] frontend =
// "native"). It is the C++ twin of `python -m epick.frontend.worker`: the service's
// Workers supervisor starts N of them on the shared ext_proc port (SO_REUSEPORT), and
// each hands only the decision to the service's Hub over its Unix socket.
//
// Why native: in grpc.aio, gRPC's own asyncio machinery cost ~6x epick's code per body
// chunk. Here a chunk is parsed in place and answered with a sub-slice of the message it
// came in (no copy of the body), on gRPC's own threads.
//
// What stays in Python (the Hub, in the service's process), so decisions and their
// answers are byte-for-byte the ones the Python front end makes: reading the OpenAI
// body, the subset hint, the pick, and every routing answer or error response (the
// PickHttp frame -> Routed). What is done here: the ext_proc state machine (BUFFERED
// and FULL_DUPLEX_STREAMED), echoing body chunks, the response-headers answer, TTFT and
// the raw usage lines (decoded by the Hub with epick.api.usage's rules) and the
// completion report; observer streams (observability_mode, envoy-observer.yaml) and
// the routing streams an observer reports for (x-epick-observed); Health Check/Watch. Messages are hand-parsed protobuf (no codegen): the field numbers
// below are Envoy's, checked by talking to this worker with Envoy's Python classes
// (tests/envoy/test_native_protocol.py, test_native_envoy.py: the answers parsed, and
// the streamed ones byte-equal to protobuf's own serialization).
#include <absl/synchronization/mutex.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// ---- settings (command line; the supervisor passes them) --------------------------

struct Settings {
  int index = 0;
  std::string hub, listen, metadata_namespace = "envoy.lb";
  size_t max_body_bytes = 4u << 20;
  bool expose_endpoint = false, conformance_hooks = false;
  // Bench only (EPICK_EXTPROC_FIXED=1, `epick bench envoy load --frontend native-fixed`):
  // the Hub decides the first request of each shape (mode, how the body ended); every
  // later one gets that answer replayed, byte for byte, without asking the Hub and
  // without a completion report. Envoy's ext_proc work stays what it is; epick's
  // decision costs nothing: the ceiling any front end can reach on the machine.
  bool fixed = false;
};
Settings g;

const char kDestination[] = "x-gateway-destination-endpoint";
const char kServed[] = "x-gateway-destination-endpoint-served";
const char kDecision[] = "x-epick-decision-id";
const char kTestServed[] = "x-conformance-test-served-endpoint";
const char kTestSelected[] = "x-conformance-test-selected-endpoint";
const size_t kMaxLine = 1u << 20;  // epick.api.usage.MAX_LINE_BYTES
const size_t kKeptUsageLines = 4;  // the Hub applies them in order: the last good one wins

// BodySendMode (envoy.extensions.filters.http.ext_proc.v3.ProcessingMode)
enum { NONE = 0, BUFFERED = 2, BUFFERED_PARTIAL = 3, DUPLEX = 4 };
enum Status { OK = 0, ERROR = 1, CANCELLED = 2 };  // epick.abi.CompletionStatus

// ---- protobuf, by hand ---------------------------------------------------------------

struct Span {
  const uint8_t* p = nullptr;
  size_t n = 0;
  std::string str() const { return std::string(reinterpret_cast<const char*>(p), n); }
};

// Iterates the fields of one message; `ok` turns false on malformed input.
struct Fields {
  const uint8_t *p, *end;
  bool ok = true;
  uint32_t num = 0, type = 0;
  uint64_t v = 0;
  Span bytes;
  explicit Fields(Span s) : p(s.p), end(s.p + s.n) {}
  bool varint(uint64_t* out) {
    uint64_t r = 0;
    for (int shift = 0; shift < 64 && p < end; shift += 7) {
      uint8_t b = *p++;
      r |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return *out = r, true;
    }
    return ok = false;
  }
  bool next() {
    if (!ok || p >= end) return false;
    uint64_t key;
    if (!varint(&key)) return false;
    num = key >> 3, type = key & 7;
    switch (type) {
      case 0: return varint(&v);
      case 1: if (end - p < 8) return ok = false; p += 8; return true;
      case 5: if (end - p < 4) return ok = false; p += 4; return true;
      case 2:
        if (!varint(&v) || uint64_t(end - p) < v) return ok = false;
        bytes = {p, size_t(v)};
        p += v;
        return true;
      default: return ok = false;
    }
  }
};

void put_varint(std::string& out, uint64_t n) {
  while (n > 0x7f) out.push_back(char((n & 0x7f) | 0x80)), n >>= 7;
  out.push_back(char(n));
}
void put_len(std::string& out, uint32_t field, const std::string& body) {
  put_varint(out, field << 3 | 2);
  put_varint(out, body.size());
  out += body;
}

// HeaderValueOption{header{key, raw_value}, append_action=OVERWRITE_IF_EXISTS_OR_ADD}:
// what ext_proc.py's _header writes.
std::string header_option(const std::string& key, const std::string& value) {
  std::string hv, opt;
  put_len(hv, 1, key);
  if (!value.empty()) put_len(hv, 3, value);
  put_len(opt, 1, hv);
  opt += "\x18\x02";
  return opt;
}

// ---- msgpack, by hand (the wire.py frames) --------------------------------------------

struct Pack {
  std::string b;
  void u8(uint8_t c) { b.push_back(char(c)); }
  void be(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) u8(uint8_t(v >> (8 * i)));
  }
  void array(size_t n) { n < 16 ? u8(0x90 | n) : (u8(0xdd), be(n, 4)); }
  void map(size_t n) { n < 16 ? u8(0x80 | n) : (u8(0xdf), be(n, 4)); }
  void nil() { u8(0xc0); }
  void boolean(bool v) { u8(v ? 0xc3 : 0xc2); }
  void integer(int64_t v) {
    if (v >= 0 && v < 128) return u8(uint8_t(v));
    if (v < 0 && v >= -32) return u8(uint8_t(v));
    u8(0xd3), be(uint64_t(v), 8);
  }
  void f64(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    u8(0xcb), be(bits, 8);
  }
  void str(const std::string& s) {
    s.size() < 32 ? u8(0xa0 | s.size()) : (u8(0xdb), be(s.size(), 4));
    b += s;
  }
  void bin(const char* p, size_t n) {
    u8(0xc6), be(n, 4);
    b.append(p, n);
  }
  void bin(const std::string& s) { bin(s.data(), s.size()); }
};

struct Obj {  // a decoded msgpack value (only what the Hub sends)
  enum Kind { Nil, Bool, Int, Float, Str, Arr, Map } kind = Nil;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<Obj> a;
};

bool unpack(const uint8_t*& p, const uint8_t* end, Obj& o, int depth = 0) {
  auto need = [&](size_t n) { return size_t(end - p) >= n; };
  auto be = [&](int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; ++k) v = v << 8 | *p++;
    return v;
  };
  if (depth > 8 || !need(1)) return false;
  uint8_t c = *p++;
  size_t n = 0;
  if (c < 0x80) return o.kind = Obj::Int, o.i = c, true;
  if (c >= 0xe0) return o.kind = Obj::Int, o.i = int8_t(c), true;
  if ((c & 0xe0) == 0xa0) { n = c & 0x1f; goto str; }
  if ((c & 0xf0) == 0x90) { n = c & 0x0f; goto arr; }
  if ((c & 0xf0) == 0x80) { n = c & 0x0f; goto map; }
  switch (c) {
    case 0xc0: return o.kind = Obj::Nil, true;
    case 0xc2: case 0xc3: return o.kind = Obj::Bool, o.i = c == 0xc3, true;
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
      int w = 1 << (c - 0xcc);
      if (!need(w)) return false;
      return o.kind = Obj::Int, o.i = int64_t(be(w)), true;
    }
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
      int w = 1 << (c - 0xd0);
      if (!need(w)) return false;
      uint64_t v = be(w);
      int shift = 64 - 8 * w;
      return o.kind = Obj::Int, o.i = int64_t(v << shift) >> shift, true;
    }
    case 0xca: { if (!need(4)) return false; uint32_t b = be(4); float f; std::memcpy(&f, &b, 4); return o.kind = Obj::Float, o.f = f, true; }
    case 0xcb: { if (!need(8)) return false; uint64_t b = be(8); std::memcpy(&o.f, &b, 8); return o.kind = Obj::Float, true; }
    case 0xd9: case 0xc4: if (!need(1)) return false; n = be(1); goto str;
    case 0xda: case 0xc5: if (!need(2)) return false; n = be(2); goto str;
    case 0xdb: case 0xc6: if (!need(4)) return false; n = be(4); goto str;
    case 0xdc: if (!need(2)) return false; n = be(2); goto arr;
    case 0xdd: if (!need(4)) return false; n = be(4); goto arr;
    case 0xde: if (!need(2)) return false; n = be(2); goto map;
    case 0xdf: if (!need(4)) return false; n = be(4); goto map;
    default: return false;
  }
str:  // str and bin alike: bytes
  if (!need(n)) return false;
  o.kind = Obj::Str, o.s.assign(reinterpret_cast<const char*>(p), n), p += n;
  return true;
arr:
  o.kind = Obj::Arr, o.a.resize(n);
  for (auto& e : o.a)
    if (!unpack(p, end, e, depth + 1)) return false;
  return true;
map:
  o.kind = Obj::Map, o.a.resize(2 * n);
  for (auto& e : o.a)
    if (!unpack(p, end, e, depth + 1)) return false;
  return true;
}

std::mutex fixed_mu;
std::map<int, Obj> fixed_answers;  // --fixed: fixed_key() -> the Routed frame replayed

bool fixed_load(int key, Obj* out) {
  std::lock_guard<std::mutex> lock(fixed_mu);
  auto it = fixed_answers.find(key);
  if (it == fixed_answers.end()) return false;
  *out = it->second;
  return true;
}
void fixed_store(int key, const Obj& m) {
  std::lock_guard<std::mutex> lock(fixed_mu);
  fixed_answers.emplace(key, m);
}

// ---- the hub connection -----------------------------------------------------------

class Stream;

class Hub {
 public:
  bool connect(const std::string& path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (fd_ < 0 || path.size() >= sizeof(addr.sun_path)) return false;
    std::memcpy(addr.sun_path, path.data(), path.size());
    return ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  // Frames from many threads, in order, few writes: a thread appends its frame; the
  // first to find no write under way writes everything pending (its own and what the
  // others appended meanwhile) until nothing is left.
  void send(const Pack& msg) {
    uint32_t n = msg.b.size();
    char len[4];
    std::memcpy(len, &n, 4);  // little-endian on every platform Debian builds this for
    std::unique_lock<std::mutex> lock(write_mu_);
    unsent_.append(len, 4);
    unsent_ += msg.b;
    if (flushing_) return;
    flushing_ = true;
    std::string out;
    while (!unsent_.empty()) {
      out.clear();
      out.swap(unsent_);
      lock.unlock();
      for (size_t off = 0; off < out.size();) {
        ssize_t w = ::write(fd_, out.data() + off, out.size() - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;  // the reader sees the hub gone and stops the worker
        off += w;
      }
      lock.lock();
    }
    flushing_ = false;
  }
  uint64_t enroll(Stream* s) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = ++next_;
    pending_[id] = s;
    return id;
  }
  void forget(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(id);
  }
  void read_loop();  // until the hub goes away
  std::atomic<bool> serving{false}, lost{false};

 private:
  // `n` bytes from the socket, read in large pieces (one read carries many frames).
  bool read_all(void* out, size_t n) {
    auto* p = static_cast<char*>(out);
    while (n) {
      if (rpos_ == rbuf_.size()) {
        rbuf_.resize(1 << 16);
        rpos_ = 0;
        ssize_t r = ::read(fd_, &rbuf_[0], rbuf_.size());
        if (r < 0 && errno == EINTR) {
          rbuf_.clear();
          continue;
        }
        if (r <= 0) return false;
        rbuf_.resize(size_t(r));
      }
      size_t take = std::min(n, rbuf_.size() - rpos_);
      std::memcpy(p, rbuf_.data() + rpos_, take);
      rpos_ += take, p += take, n -= take;
    }
    return true;
  }
  int fd_ = -1;
  std::mutex write_mu_, mu_;
  std::string unsent_;  // frames not yet written (under write_mu_)
  bool flushing_ = false;
  std::string rbuf_;  // read_loop's: bytes read and not yet framed
  size_t rpos_ = 0;
  uint64_t next_ = 0;
  std::unordered_map<uint64_t, Stream*> pending_;
};
Hub hub;

// ---- usage and TTFT (epick.api.usage.UsageReader's rules; the Hub decodes) ----------

struct Usage {
  bool on = false, sse = false, json = false, over = false;
  double ttft_s = -1;
  std::string tail, body;
  std::deque<std::string> events;  // payloads after "data:" of lines naming "usage"

  void start(const std::string& content_type) {
    std::string t = content_type.substr(0, content_type.find(';'));
    size_t a = t.find_first_not_of(" \t"), b = t.find_last_not_of(" \t");
    t = a == std::string::npos ? "" : t.substr(a, b - a + 1);
    for (auto& c : t) c = char(std::tolower(static_cast<unsigned char>(c)));
    on = true, sse = t == "text/event-stream", json = t == "application/json";
  }
  void line(const char* p, size_t n) {
    static const std::string key = "\"usage\"";
    if (n >= 5 && std::memcmp(p, "data:", 5) == 0 &&
        std::string_view(p, n).find(key) != std::string_view::npos) {
      events.emplace_back(p + 5, n - 5);
      if (events.size() > kKeptUsageLines) events.pop_front();
    }
  }
  void lines(std::string_view data) {  // complete lines only (split on \n)
    if (data.find("\"usage\"") == std::string_view::npos) return;  // the common chunk
    size_t pos = 0;
    while (pos <= data.size()) {
      size_t nl = data.find('\n', pos);
      if (nl == std::string_view::npos) nl = data.size();
      line(data.data() + pos, nl - pos);
      pos = nl + 1;
    }
  }
  void feed(const uint8_t* p, size_t n, Clock::time_point started) {
    if (!on || !n) return;
    std::string_view chunk(reinterpret_cast<const char*>(p), n);
    if (sse) {
      if (ttft_s < 0)
        ttft_s = std::max(0.0, std::chrono::duration<double>(Clock::now() - started).count());
      if (tail.empty() && chunk.back() == '\n') return lines(chunk.substr(0, n - 1));
      std::string data = tail + std::string(chunk);
      size_t cut = data.rfind('\n');
      if (cut == std::string::npos) {
        tail = data.size() <= kMaxLine ? data : "";
        return;
      }
      tail = data.substr(cut + 1);
      lines(std::string_view(data).substr(0, cut));
    } else if (json && !over) {
      if (body.size() + n > g.max_body_bytes)
        over = true, body.clear();
      else
        body.append(chunk);
    }
  }
  void finish() {
    if (sse && !tail.empty()) line(tail.data(), tail.size()), tail.clear();
  }
};

// ---- one ext_proc stream ---------------------------------------------------------------

std::string latin1_to_utf8(Span s) {  // ext_proc.py's raw_value.decode("latin-1")
  std::string out;
  out.reserve(s.n);
  for (size_t i = 0; i < s.n; ++i) {
    uint8_t c = s.p[i];
    if (c < 0x80) {
      out.push_back(char(c));
    } else {
      out.push_back(char(0xc0 | c >> 6));
      out.push_back(char(0x80 | (c & 0x3f)));
    }
  }
  return out;
}

// HttpHeaders -> (name, value) in order; sets *eos.
std::vector<std::pair<std::string, std::string>> read_headers(Span msg, bool* eos) {
  std::vector<std::pair<std::string, std::string>> out;
  for (Fields f(msg); f.next();) {
    if (f.num == 3 && f.type == 0) *eos = f.v != 0;
    if (f.num != 1 || f.type != 2) continue;
    for (Fields m(f.bytes); m.next();) {  // HeaderMap.headers
      if (m.num != 1 || m.type != 2) continue;
      std::string key, value;
      Span raw;
      for (Fields h(m.bytes); h.next();) {
        if (h.type != 2) continue;
        if (h.num == 1) key = h.bytes.str();
        else if (h.num == 2) value = h.bytes.str();
        else if (h.num == 3) raw = h.bytes;
      }
      out.emplace_back(std::move(key), raw.n ? latin1_to_utf8(raw) : value);
    }
  }
  return out;
}

std::string lookup(const std::vector<std::pair<std::string, std::string>>& headers,
                   const char* name) {
  std::string v;
  for (auto& kv : headers)
    if (kv.first == name) v = kv.second;  // the last wins, as the dict in ext_proc.py
  return v;
}

// The served endpoint in a ProcessingRequest's metadata_context: walks
// filter_metadata[g.metadata_namespace].fields[x-gateway-destination-endpoint-served]
// (Struct -> Value.string_value). Returns -1 when no entry names the namespace, 0 when
// one does but none carries the key, 1 when one does (then *served is the last found).
// One walk for the routing stream (read_metadata) and the observer (read_served).
// One protobuf map entry<string, message>: its key (field 1) and value (field 2).
static void map_entry(Span entry, std::string* key, Span* value) {
  for (Fields e(entry); e.next();) {
    if (e.num == 1 && e.type == 2) *key = e.bytes.str();
    if (e.num == 2 && e.type == 2) *value = e.bytes;
  }
}

int served_in(Span meta, std::string* served) {
  int seen = -1;
  for (Fields f(meta); f.next();) {  // Metadata.filter_metadata (map entries)
    if (f.num != 1 || f.type != 2) continue;
    std::string key;
    Span value;
    map_entry(f.bytes, &key, &value);
    if (key != g.metadata_namespace) continue;
    seen = std::max(seen, 0);
    for (Fields s(value); s.next();) {  // Struct.fields (map entries)
      if (s.num != 1 || s.type != 2) continue;
      std::string k;
      Span v;
      map_entry(s.bytes, &k, &v);
      if (k != kServed) continue;
      seen = 1, served->clear();
      for (Fields x(v); x.next();)  // Value.string_value
        if (x.num == 3 && x.type == 2) *served = x.bytes.str();
    }
  }
  return seen;
}

// HttpBody{body = 1, end_of_stream = 2}: the body (a span of the message) and *eos.
Span http_body(Span part, bool* eos) {
  Span body;
  for (Fields f(part); f.next();) {
    if (f.num == 1 && f.type == 2) body = f.bytes;
    if (f.num == 2 && f.type == 0) *eos = f.v != 0;
  }
  return body;
}

// The answer's :status as a number, -1 when absent or not digits (ext_proc.py's rule).
int http_status(const std::vector<std::pair<std::string, std::string>>& headers) {
  std::string status = lookup(headers, ":status");
  if (status.empty() || status.size() >= 10 ||
      status.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoi(status);
}

const uint8_t kRequestHeadersContinue[] = {0x0a, 0x00};
const uint8_t kRequestTrailersContinue[] = {0x2a, 0x00};
const uint8_t kResponseHeadersContinue[] = {0x12, 0x00};
const uint8_t kResponseBodyContinue[] = {0x22, 0x00};
const uint8_t kResponseTrailersContinue[] = {0x32, 0x00};

class Stream : public grpc::ServerGenericBidiReactor {
 public:
  // `observed`: the routing filter's gRPC initial metadata says an observer filter
  // reports this request's completion (ext_proc.py's OBSERVED_METADATA).
  explicit Stream(bool observed) : observed_(observed) { StartRead(&in_); }

  // Called on the hub reader's thread, under the hub's lock (so `this` is alive).
  void routed(const Obj& m) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (learn_ && !m.a[4].i && !m.a[5].s.empty()) fixed_store(fixed_key(), m);
    if (!apply(m)) return;
    if (!ended_) StartRead(&in_);
    maybe_finish();
  }

  // The Hub's answer (a Routed frame) written out; false when the stream is already over.
  bool apply(const Obj& m) {
    waiting_ = false;
    id_ = 0;
    if (finished_) return false;
    const auto& head = m.a[2].a;
    int64_t echo_at = m.a[3].i;
    ended_ = m.a[4].i != 0;
    decision_id_ = m.a[5].s;
    endpoint_ = m.a[6].s;
    for (size_t i = 0; i <= head.size(); ++i) {
      if (int64_t(i) == echo_at) {
        for (size_t c = 0; c < chunks_.size(); ++c)
          send_streamed(0x1a, chunks_[c], end_ == 1 && c + 1 == chunks_.size());
      }
      if (i < head.size()) send(grpc::Slice(head[i].s));
    }
    chunks_.clear();
    return true;
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!ok) {
      read_closed_ = true;
      return maybe_finish();
    }
    grpc::Slice whole;
    if (!in_.DumpToSingleSlice(&whole).ok()) return fail("unreadable message");
    in_.Clear();
    handle(whole);
    if (!waiting_ && !ended_ && !finished_) StartRead(&in_);
    maybe_finish();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    out_.pop_front();
    writing_ = false;
    if (!ok) broken_ = true, out_.clear();
    if (!out_.empty()) writing_ = true, StartWrite(&out_.front());
    maybe_finish();
  }

  void OnCancel() override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    cancelled_ = true;
    maybe_finish();
  }

  void OnDone() override {
    // The hub's lock before ours (the order routed() takes them in).
    if (uint64_t id = id_.load()) hub.forget(id);
    {
      std::lock_guard<std::recursive_mutex> lock(mu_);
      end_report();
    }
    delete this;
  }

 private:
  // -- dispatch ------------------------------------------------------------------------
  void handle(const grpc::Slice& whole) {
    Span msg{whole.begin(), whole.size()};
    uint32_t kind = 0;
    Span part, meta;
    bool has_meta = false, observe = false, has_config = false;
    int req_mode = NONE, resp_mode = NONE;  // proto3: an absent mode is 0
    Fields f(msg);
    while (f.next()) {
      if (f.num >= 2 && f.num <= 7 && f.type == 2) kind = f.num, part = f.bytes;
      else if (f.num == 8 && f.type == 2) has_meta = true, meta = f.bytes;
      else if (f.num == 10 && f.type == 0) observe = f.v != 0;
      else if (f.num == 11 && f.type == 2) {
        has_config = true;
        for (Fields c(f.bytes); c.next();) {
          if (c.num == 1 && c.type == 0) req_mode = int(c.v);
          if (c.num == 2 && c.type == 0) resp_mode = int(c.v);
        }
      }
    }
    if (!f.ok) return fail("malformed ProcessingRequest");
    if (first_) observer_ = observe;
    first_ = false;
    if (observer_) return observe_message(kind, part, has_meta ? &meta : nullptr);
    if (has_meta) read_metadata(meta);
    switch (kind) {
      case 5: return response_body(part, whole);
      case 2: return request_headers(part, has_config, req_mode, resp_mode);
      case 4: return request_body(part, whole);
      case 6:
        if (duplex_ && decision_id_.empty()) return route(2);
        return send_static(kRequestTrailersContinue);
      case 3: return response_headers(part);
      case 7:
        response_end();
        return send_static(kResponseTrailersContinue);
      default: return problem("unexpected");
    }
  }

  // -- an observer stream (observability_mode: Envoy never waits; nothing is answered) --
  // ext_proc.py's _Observer: the decision id from the answer's x-epick-decision-id (the
  // routing filter set it), TTFT from this stream's request headers; reported once, at
  // the answer's end (then the stream ends), else CANCELLED when the stream ends.
  void observe_message(uint32_t kind, Span part, const Span* meta) {
    switch (kind) {
      case 5: {  // response_body: the most frequent
        bool eos = false;
        Span body = http_body(part, &eos);
        usage_.feed(body.p, body.n, started_);
        if (eos) observer_end();
        return;
      }
      case 2: started_ = Clock::now(); return;
      case 3: {
        bool eos = false;
        auto headers = read_headers(part, &eos);
        status_ = http_status(headers);
        decision_id_ = lookup(headers, kDecision);
        if (meta) read_served(*meta);
        if (!decision_id_.empty()) usage_.start(lookup(headers, "content-type"));
        if (eos) observer_end();
        return;
      }
      case 7: return observer_end();
      default: return;
    }
  }
  void observer_end() {
    ended_ = true;
    report(status_ >= 400 ? ERROR : OK);
  }
  void read_served(Span meta) {  // filter_metadata[namespace].fields[SERVED], if there
    std::string served;
    if (served_in(meta, &served) == 1) served_ = served;
  }

  // -- the request -----------------------------------------------------------------------
  void request_headers(Span part, bool has_config, int req_mode, int resp_mode) {
    bool eos = false;
    headers_ = read_headers(part, &eos);
    started_ = Clock::now();
    int mode = has_config ? req_mode : BUFFERED;
    if (has_config) response_mode_ = resp_mode;
    duplex_ = mode == DUPLEX;
    if (eos) return route(0);
    if (mode != DUPLEX && mode != BUFFERED && mode != BUFFERED_PARTIAL)
      return problem("mode:" + std::to_string(mode));
    if (!duplex_) send_static(kRequestHeadersContinue);
  }

  void request_body(Span part, const grpc::Slice& whole) {
    bool eos = false;
    Span body = http_body(part, &eos);
    size_ += body.n;
    if (size_ > g.max_body_bytes) return problem("too_large");
    if (!duplex_ && !eos) return problem("not_buffered");
    chunks_.push_back(whole.sub(body.p - whole.begin(), body.p - whole.begin() + body.n));
    if (!duplex_ || eos) route(1);
  }

  // Ask the Hub; `end`: 0 = body-less, 1 = the body ended, 2 = trailers follow.
  void route(int end) {
    end_ = end;
    if (g.fixed) {  // the bench's ceiling: the first answer of this shape, replayed
      Obj cached;
      if (fixed_load(fixed_key(), &cached)) {
        fixed_ = true;
        apply(cached);  // on the read's thread: OnReadDone reads on
        return;
      }
      learn_ = true;
    }
    Pack p;
    p.array(9);
    p.integer(10);  // wire.PickHttp
    id_ = hub.enroll(this);
    p.integer(int64_t(id_.load()));
    p.map(headers_.size());
    for (auto& kv : headers_) p.str(kv.first), p.str(kv.second);
    size_t total = 0;
    for (auto& c : chunks_) total += c.size();
    p.u8(0xc6), p.be(total, 4);
    for (auto& c : chunks_) p.b.append(reinterpret_cast<const char*>(c.begin()), c.size());
    p.array(metadata_.size());
    for (auto& m : metadata_) p.bin(m);
    metadata_.clear();
    p.integer(end);
    p.boolean(duplex_);
    p.f64(std::chrono::duration<double>(Clock::now() - started_).count());
    p.str("");
    waiting_ = true;
    hub.send(p);
  }

  // A refusal the worker sees first (too large, a mode epick cannot route): the Hub
  // writes the same immediate response the Python front end would.
  void problem(const std::string& what) {
    Pack p;
    p.array(9);
    p.integer(10);
    id_ = hub.enroll(this);
    p.integer(int64_t(id_.load()));
    p.map(0);
    p.bin("", 0);
    p.array(0);
    p.integer(0);
    p.boolean(duplex_);
    p.f64(0);
    p.str(what);
    waiting_ = true;
    hub.send(p);
  }

  void read_metadata(Span meta) {
    // filter_metadata[namespace].fields[SERVED]: the endpoint the data plane used.
    std::string served;
    int seen = served_in(meta, &served);
    lb_metadata_ = std::max(lb_metadata_, seen);
    if (seen == 1) served_ = served;
    if (decision_id_.empty()) metadata_.push_back(std::string(reinterpret_cast<const char*>(meta.p), meta.n));
  }

  // -- the response ----------------------------------------------------------------------
  void response_headers(Span part) {
    bool eos = false;
    auto headers = read_headers(part, &eos);
    status_ = http_status(headers);
    if (response_mode_ != NONE && !decision_id_.empty())
      usage_.start(lookup(headers, "content-type"));
    if (eos) response_end();
    if (decision_id_.empty() && observed_) {
      // The observer reports the id it reads on the answer: only epick's may be there.
      std::string mutation, common, headers_response, out;
      put_len(mutation, 2, kDecision);
      put_len(common, 2, mutation);
      put_len(headers_response, 1, common);
      put_len(out, 2, headers_response);
      return send(grpc::Slice(out));
    }
    if (decision_id_.empty()) return send_static(kResponseHeadersContinue);
    std::string mutation;
    put_len(mutation, 1, header_option(kDecision, decision_id_));
    if (g.expose_endpoint)
      put_len(mutation, 1, header_option(kDestination, served_.empty() ? endpoint_ : served_));
    if (g.conformance_hooks) {
      std::string served = !served_.empty() ? served_
                           : lb_metadata_ < 0 ? "fail: missing envoy lb metadata"
                                              : "fail: missing destination endpoint served metadata";
      put_len(mutation, 1, header_option(kTestServed, served));
      put_len(mutation, 1, header_option(kTestSelected, endpoint_));
    }
    if (!g.expose_endpoint) put_len(mutation, 2, kDestination);
    std::string common, headers_response, out;
    put_len(common, 2, mutation);
    put_len(headers_response, 1, common);
    put_len(out, 2, headers_response);
    send(grpc::Slice(out));
  }

  void response_body(Span part, const grpc::Slice& whole) {
    bool eos = false;
    Span body = http_body(part, &eos);
    usage_.feed(body.p, body.n, started_);
    if (eos) response_end();
    if (response_mode_ == DUPLEX)
      return send_streamed(0x22, whole.sub(body.p - whole.begin(), body.p - whole.begin() + body.n), eos);
    send_static(kResponseBodyContinue);
  }

  void response_end() {
    if (response_done_) return;
    response_done_ = true;
    if (observed_) return;  // the observer saw the same end, with the body: it reports
    report(status_ >= 400 ? ERROR : OK);
  }

  // -- completion ------------------------------------------------------------------------
  void report(Status status) {
    if (decision_id_.empty() || reported_ || fixed_) return;
    reported_ = true;
    usage_.finish();
    Pack p;
    p.array(9);
    p.integer(3);  // wire.Complete, with the raw usage the Hub decodes
    p.str(decision_id_);
    p.str(served_.empty() ? endpoint_ : served_);
    p.integer(status);
    p.nil();
    p.nil();
    if (usage_.ttft_s >= 0) p.f64(usage_.ttft_s); else p.nil();
    p.str(usage_.sse ? "sse" : usage_.json ? "json" : "");
    if (usage_.json && !usage_.over && !usage_.body.empty()) {
      p.array(1);
      p.bin(usage_.body);
    } else {
      p.array(usage_.sse ? usage_.events.size() : 0);
      if (usage_.sse)
        for (auto& e : usage_.events) p.bin(e);
    }
    hub.send(p);
  }

  void end_report() {  // ext_proc.py's _Stream.finish (and _Observer.finish)
    if (reported_ || decision_id_.empty()) return;
    if (observer_) return report(CANCELLED);  // the answer never ended
    if (observed_ && status_ >= 0) return;  // the answer carried the id: the observer reports
    if (status_ < 0) return report(CANCELLED);
    if (response_mode_ != NONE && !response_done_) return report(CANCELLED);
    report(status_ >= 400 ? ERROR : OK);
  }

  // -- writing ---------------------------------------------------------------------------
  // A streamed chunk: ProcessingResponse{kind: BodyResponse{response: CommonResponse{
  // body_mutation: BodyMutation{streamed_response: {body, end_of_stream}}}}}, as
  // ext_proc.py's _streamed writes it; the body slice is the request's own bytes.
  void send_streamed(uint8_t kind_tag, const grpc::Slice& chunk, bool eos) {
    // The four nested heads and the body's own, written inward on the stack (at most
    // 5 x (1 + 10) bytes): one small slice a chunk beside the body's, no string built.
    static const uint8_t kEos[] = {0x10, 0x01};  // end_of_stream: true
    size_t sizes[4];
    sizes[0] = (chunk.size() ? 1 + varint_size(chunk.size()) + chunk.size() : 0) + (eos ? 2 : 0);
    for (int i = 1; i < 4; ++i) sizes[i] = 1 + varint_size(sizes[i - 1]) + sizes[i - 1];
    const uint8_t tags[] = {kind_tag, 0x0a /*response*/, 0x1a /*body_mutation*/,
                            0x1a /*streamed_response*/};
    uint8_t head[64];
    size_t n = 0;
    for (int i = 0; i < 4; ++i) head[n++] = tags[i], n += varint_to(head + n, sizes[3 - i]);
    if (chunk.size()) {
      head[n++] = 0x0a;  // body
      n += varint_to(head + n, chunk.size());
      grpc::Slice parts[3] = {grpc::Slice(head, n), chunk,
                              grpc::Slice(kEos, 2, grpc::Slice::STATIC_SLICE)};
      out_.emplace_back(parts, eos ? 3 : 2);
    } else {
      if (eos) head[n++] = kEos[0], head[n++] = kEos[1];
      grpc::Slice only(head, n);
      out_.emplace_back(&only, 1);
    }
    kick();
  }
  static size_t varint_to(uint8_t* out, uint64_t v) {
    size_t k = 0;
    while (v > 0x7f) out[k++] = uint8_t((v & 0x7f) | 0x80), v >>= 7;
    out[k++] = uint8_t(v);
    return k;
  }
  static size_t varint_size(uint64_t n) {
    size_t k = 1;
    while (n > 0x7f) n >>= 7, ++k;
    return k;
  }
  template <size_t N>
  void send_static(const uint8_t (&bytes)[N]) {
    send(grpc::Slice(bytes, N, grpc::Slice::STATIC_SLICE));
  }
  void send(const grpc::Slice& s) {
    out_.emplace_back(&s, 1);
    kick();
  }
  void kick() {
    if (!writing_ && !broken_) writing_ = true, StartWrite(&out_.front());
  }
  void fail(const char* why) {
    finished_ = true;
    Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why));
  }
  void maybe_finish() {
    if (finished_ || writing_) return;
    if (cancelled_ || broken_ || (read_closed_ && !waiting_) || (ended_ && !waiting_)) {
      finished_ = true;
      Finish(cancelled_ ? grpc::Status::CANCELLED : grpc::Status::OK);
    }
  }

  std::recursive_mutex mu_;
  grpc::ByteBuffer in_;
  std::deque<grpc::ByteBuffer> out_;
  bool writing_ = false, read_closed_ = false, ended_ = false, finished_ = false;
  bool waiting_ = false, cancelled_ = false, broken_ = false, first_ = true;
  bool duplex_ = false, response_done_ = false, reported_ = false;
  bool observed_ = false;  // routing, with an observer filter reporting (x-epick-observed)
  bool observer_ = false;  // this stream is the observer (observability_mode)
  int response_mode_ = NONE, status_ = -1, end_ = 0;
  bool fixed_ = false, learn_ = false;  // --fixed: replayed / the answer to replay
  int fixed_key() const { return (duplex_ ? 4 : 0) + end_; }
  int lb_metadata_ = -1;  // -1: no namespace seen; 0: no served key; 1: served key seen
  std::atomic<uint64_t> id_{0};
  size_t size_ = 0;
  Clock::time_point started_ = Clock::now();
  std::vector<std::pair<std::string, std::string>> headers_;
  std::vector<grpc::Slice> chunks_;
  std::vector<std::string> metadata_;
  std::string decision_id_, endpoint_, served_;
  Usage usage_;
};

// ---- grpc.health.v1.Health (the names the Python worker serves, with its answers) --------

// HealthCheckResponse.ServingStatus
const int kServing = 1, kNotServing = 2, kServiceUnknown = 3;

int health_status(const std::string& name) {
  if (name == "liveness") return kServing;
  if (name.empty() || name == "readiness" || name == "epick.v1.EndpointPicker" ||
      name == "envoy.service.ext_proc.v3.ExternalProcessor")
    return hub.serving ? kServing : kNotServing;
  return kServiceUnknown;
}

std::string health_name(grpc::ByteBuffer& in) {  // HealthCheckRequest.service
  grpc::Slice s;
  std::string name;
  if (!in.DumpToSingleSlice(&s).ok()) return name;
  for (Fields f(Span{s.begin(), s.size()}); f.next();)
    if (f.num == 1 && f.type == 2) name = f.bytes.str();
  return name;
}

grpc::ByteBuffer health_reply(int status) {  // HealthCheckResponse{status}
  const uint8_t reply[] = {0x08, uint8_t(status)};
  grpc::Slice r(reply, 2);
  return grpc::ByteBuffer(&r, 1);
}

// Health/Watch: the status now, then each change the Hub tells (grpc_health's servicer:
// SERVICE_UNKNOWN for a name it does not serve, and the stream stays open).
class Watch;
std::mutex watch_mu;  // before any Watch's own lock
std::set<Watch*> watchers;

class Watch : public grpc::ServerGenericBidiReactor {
 public:
  Watch() { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
    name_ = health_name(in_);
    {
      std::lock_guard<std::mutex> lock(watch_mu);
      watchers.insert(this);
    }
    update();
  }
  void update() {
    std::lock_guard<std::mutex> lock(mu_);
    pump();
  }
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) cancelled_ = true;
    pump();
  }
  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    pump();
  }
  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(watch_mu);
      watchers.erase(this);
    }
    delete this;
  }

 private:
  void pump() {  // under mu_: write the status if it changed since the last one written
    if (finished_ || writing_) return;
    if (cancelled_) {
      finished_ = true;
      return Finish(grpc::Status::CANCELLED);
    }
    int status = health_status(name_);
    if (status == sent_) return;
    sent_ = status;
    out_ = health_reply(status);
    writing_ = true;
    StartWrite(&out_);
  }
  std::mutex mu_;
  std::string name_;
  grpc::ByteBuffer in_, out_;
  int sent_ = 0;
  bool writing_ = false, cancelled_ = false, finished_ = false;
};

void health_changed() {
  std::lock_guard<std::mutex> lock(watch_mu);
  for (Watch* w : watchers) w->update();
}

void Hub::read_loop() {
  std::string buf;
  for (;;) {
    uint32_t n;
    if (!read_all(&n, 4) || n > (33u << 20)) break;
    buf.resize(n);
    if (!read_all(&buf[0], n)) break;
    const uint8_t* p = reinterpret_cast<const uint8_t*>(buf.data());
    Obj m;
    if (!unpack(p, p + n, m) || m.kind != Obj::Arr || m.a.empty()) break;
    int64_t tag = m.a[0].i;
    if (tag == 5 && m.a.size() >= 2) {  // wire.Health
      serving = m.a[1].i != 0;
      health_changed();
    } else if (tag == 11 && m.a.size() >= 7) {  // wire.Routed
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(uint64_t(m.a[1].i));
      if (it != pending_.end()) {
        Stream* s = it->second;
        pending_.erase(it);
        s->routed(m);
      }
    }
  }
  std::fprintf(stderr, "epick-extproc %d: the service's process is gone; stopping\n", g.index);
  lost = true;
}

// ---- grpc.health.v1.Health/Check (unary; NOT_FOUND for an unknown name) ------------

class Health : public grpc::ServerGenericBidiReactor {
 public:
  Health() { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
    int status = health_status(health_name(in_));
    if (status == kServiceUnknown)
      return Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
    out_ = health_reply(status);
    StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer in_, out_;
};

class Service : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    const std::string& method = ctx->method();
    if (method == "/envoy.service.ext_proc.v3.ExternalProcessor/Process") {
      bool observed = false;
      for (auto& kv : ctx->client_metadata()) {
        if (std::string_view(kv.first.data(), kv.first.size()) != "x-epick-observed") continue;
        std::string v(kv.second.data(), kv.second.size());
        size_t a = v.find_first_not_of(" \t"), b = v.find_last_not_of(" \t");
        v = a == std::string::npos ? "" : v.substr(a, b - a + 1);
        for (auto& c : v) c = char(std::tolower(static_cast<unsigned char>(c)));
        observed = v == "true" || v == "1";
        break;  // the first, as ext_proc.py's _observed
      }
      return new Stream(observed);
    }
    if (method == "/grpc.health.v1.Health/Check") return new Health();
    if (method == "/grpc.health.v1.Health/Watch") return new Watch();
    return grpc::CallbackGenericService::CreateReactor(ctx);
  }
};

int usage_exit(const char* arg) {
  std::fprintf(stderr,
               "usage: epick-extproc --index N --hub SOCKET --listen HOST:PORT "
               "[--max-body-bytes N] [--metadata-namespace NS] [--expose-endpoint 0|1] "
               "[--conformance-hooks 0|1]\n(bad or missing: %s)\n", arg);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--index") g.index = std::atoi(v.c_str());
    else if (k == "--hub") g.hub = v;
    else if (k == "--listen") g.listen = v;
    else if (k == "--max-body-bytes") g.max_body_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--metadata-namespace") g.metadata_namespace = v;
    else if (k == "--expose-endpoint") g.expose_endpoint = v == "1";
    else if (k == "--conformance-hooks") g.conformance_hooks = v == "1";
    else return usage_exit(argv[i]);
  }
  // Debian builds abseil without NDEBUG, so every absl::Mutex lock (gRPC's own, many a
  // message) ran the debug-only deadlock check: a lock-order graph behind one global lock
  // (perf under streamed load: 3-4% of this worker's samples in absl's GraphCycles).
  // gRPC's locks are gRPC's to get right; a release build does not check them either.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (const char* fixed = std::getenv("EPICK_EXTPROC_FIXED")) g.fixed = std::string(fixed) == "1";
  if (g.fixed)
    std::fprintf(stderr, "epick-extproc %d: EPICK_EXTPROC_FIXED=1: replaying the first answer "
                 "of each shape without deciding (a benchmark's ceiling, not a service)\n",
                 g.index);
  if (g.hub.empty()) return usage_exit("--hub");
  if (g.listen.empty()) return usage_exit("--listen");
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // every thread inherits it; main waits
  ::signal(SIGPIPE, SIG_IGN);

  if (!hub.connect(g.hub)) {
    std::fprintf(stderr, "epick-extproc %d: cannot connect to the hub at %s\n", g.index,
                 g.hub.c_str());
    return 1;
  }
  std::thread(&Hub::read_loop, &hub).detach();

  Service service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(g.listen, grpc::InsecureServerCredentials(), &port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 1);
  // A BUFFERED ProcessingRequest carries the whole body (ext_proc.py's MAX_MESSAGE_BYTES).
  builder.SetMaxReceiveMessageSize(16 << 20);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || !port) {
    std::fprintf(stderr, "epick-extproc %d: cannot listen on %s\n", g.index, g.listen.c_str());
    return 1;
  }
  Pack hello;
  hello.array(3);
  hello.integer(0);  // wire.Hello
  hello.integer(g.index);
  hello.integer(getpid());
  hub.send(hello);

  timespec tick{0, 100 * 1000 * 1000};
  while (!hub.lost) {
    int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) break;
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}
