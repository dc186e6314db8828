// The strict JSON reader and compact writer behind exl2::Json (RFC 8259, UTF-8 validated, no extensions).
#include "exl2/json.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <limits>
#include <unordered_set>

#include "exl2/errors.h"

namespace exl2 {

namespace {

constexpr int kMaxDepth = 256;  // nesting of arrays/objects; deeper input is rejected, never a stack overflow

// A short, printable excerpt of a value for error messages.
std::string excerpt(const Json& j) {
  std::string s = j.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

}  // namespace

// Recursive-descent parser; `depth_` bounds the recursion.
class JsonParser {
 public:
  JsonParser(const std::string& text, const std::string& source) : s_(text), source_(source) {}

  Json parse_document() {
    skip_ws();
    Json v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected data after the top-level value");
    return v;
  }

 private:
  const std::string& s_;
  const std::string& source_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }
  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    EXL2_FAIL(ModelFormat, source_, ": invalid JSON at byte ", at, ": ", what);
  }

  static std::string describe_byte(unsigned char c) {
    if (c >= 0x20 && c < 0x7f) return str_cat("'", static_cast<char>(c), "'");
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02x", c);
    return buf;
  }

  bool at_end() const { return pos_ >= s_.size(); }
  unsigned char peek() const { return static_cast<unsigned char>(s_[pos_]); }

  void skip_ws() {
    while (!at_end()) {
      const char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
        ++pos_;
      else
        break;
    }
  }

  void expect_literal(const char* lit) {
    const size_t n = std::strlen(lit);
    if (s_.compare(pos_, n, lit) != 0) fail(str_cat("invalid literal (expected '", lit, "')"));
    pos_ += n;
  }

  Json parse_value(int depth) {
    if (at_end()) fail("unexpected end of input (expected a value)");
    const unsigned char c = peek();
    Json v;
    switch (c) {
      case '{':
        return parse_object(depth + 1);
      case '[':
        return parse_array(depth + 1);
      case '"':
        v.type_ = Json::Type::String;
        v.str_ = parse_string();
        return v;
      case 't':
        expect_literal("true");
        return Json::make_bool(true);
      case 'f':
        expect_literal("false");
        return Json::make_bool(false);
      case 'n':
        expect_literal("null");
        return Json();
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
        if (c == 'N' || c == 'I') fail("NaN and Infinity are not JSON");
        if (c == '/') fail("comments are not JSON");
        fail(str_cat("unexpected character ", describe_byte(c), " (expected a value)"));
    }
  }

  Json parse_object(int depth) {
    if (depth > kMaxDepth) fail(str_cat("nesting deeper than ", kMaxDepth, " levels"));
    ++pos_;  // '{'
    Json obj;
    obj.type_ = Json::Type::Object;
    std::unordered_set<std::string> seen;
    skip_ws();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return obj;
    }
    for (;;) {
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an object");
      if (peek() != '"') {
        if (peek() == '}') fail("trailing comma in object");
        fail(str_cat("expected a string key, got ", describe_byte(peek())));
      }
      const size_t key_pos = pos_;
      std::string key = parse_string();
      if (!seen.insert(key).second) fail_at(key_pos, str_cat("duplicate key \"", key, "\""));
      skip_ws();
      if (at_end() || peek() != ':') fail("expected ':' after object key");
      ++pos_;
      skip_ws();
      Json val = parse_value(depth);
      obj.obj_.emplace_back(std::move(key), std::move(val));
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return obj;
      }
      fail(str_cat("expected ',' or '}' in object, got ", describe_byte(peek())));
    }
  }

  Json parse_array(int depth) {
    if (depth > kMaxDepth) fail(str_cat("nesting deeper than ", kMaxDepth, " levels"));
    ++pos_;  // '['
    Json arr;
    arr.type_ = Json::Type::Array;
    skip_ws();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return arr;
    }
    for (;;) {
      skip_ws();
      if (!at_end() && peek() == ']') fail("trailing comma in array");
      arr.arr_.push_back(parse_value(depth));
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return arr;
      }
      fail(str_cat("expected ',' or ']' in array, got ", describe_byte(peek())));
    }
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  uint32_t parse_hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_ + i];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        fail_at(pos_ + i, "invalid hex digit in \\u escape");
    }
    pos_ += 4;
    return v;
  }

  // Validates one UTF-8 sequence starting at pos_ (a lead byte >= 0x80) and appends it to out.
  void take_utf8(std::string& out) {
    const size_t start = pos_;
    const unsigned char c = peek();
    int n;
    uint32_t cp, min;
    if (c >= 0xc2 && c <= 0xdf)
      n = 1, cp = c & 0x1f, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef)
      n = 2, cp = c & 0x0f, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4)
      n = 3, cp = c & 0x07, min = 0x10000;
    else
      fail(str_cat("invalid UTF-8 lead byte ", describe_byte(c)));
    if (s_.size() - pos_ <= static_cast<size_t>(n)) fail("truncated UTF-8 sequence");
    for (int i = 1; i <= n; ++i) {
      const unsigned char d = static_cast<unsigned char>(s_[pos_ + i]);
      if ((d & 0xc0) != 0x80) fail_at(pos_ + i, "invalid UTF-8 continuation byte");
      cp = (cp << 6) | (d & 0x3f);
    }
    if (cp < min) fail("overlong UTF-8 encoding");
    if (cp >= 0xd800 && cp <= 0xdfff) fail("UTF-8 encoded surrogate code point");
    if (cp > 0x10ffff) fail("UTF-8 code point above U+10FFFF");
    pos_ += n + 1;
    out.append(s_, start, n + 1);
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      const unsigned char c = peek();
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c == '\\') {
        ++pos_;
        if (at_end()) fail("unterminated escape in string");
        const char e = s_[pos_++];
        switch (e) {
          case '"':
            out += '"';
            break;
          case '\\':
            out += '\\';
            break;
          case '/':
            out += '/';
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'n':
            out += '\n';
            break;
          case 'r':
            out += '\r';
            break;
          case 't':
            out += '\t';
            break;
          case 'u': {
            const size_t esc = pos_ - 2;
            uint32_t cp = parse_hex4();
            if (cp >= 0xdc00 && cp <= 0xdfff) fail_at(esc, "unpaired low surrogate in \\u escape");
            if (cp >= 0xd800 && cp <= 0xdbff) {
              if (s_.compare(pos_, 2, "\\u") != 0) fail_at(esc, "unpaired high surrogate in \\u escape");
              pos_ += 2;
              const uint32_t lo = parse_hex4();
              if (lo < 0xdc00 || lo > 0xdfff) fail_at(esc, "high surrogate not followed by a low surrogate");
              cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            append_utf8(out, cp);
            break;
          }
          default:
            fail_at(pos_ - 1, str_cat("invalid escape \\", describe_byte(static_cast<unsigned char>(e))));
        }
        continue;
      }
      if (c < 0x20) fail(str_cat("unescaped control character ", describe_byte(c), " in string"));
      if (c < 0x80) {
        out += static_cast<char>(c);
        ++pos_;
        continue;
      }
      take_utf8(out);
    }
  }

  Json parse_number() {
    const size_t start = pos_;
    if (peek() == '-') ++pos_;
    if (at_end()) fail("truncated number");
    if (peek() == '0') {
      ++pos_;
      if (!at_end() && peek() >= '0' && peek() <= '9') fail("leading zeros are not allowed in numbers");
    } else if (peek() >= '1' && peek() <= '9') {
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
    } else {
      fail("expected a digit");
    }
    bool integral = true;
    if (!at_end() && peek() == '.') {
      integral = false;
      ++pos_;
      if (at_end() || !(peek() >= '0' && peek() <= '9')) fail("expected a digit after '.'");
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (at_end() || !(peek() >= '0' && peek() <= '9')) fail("expected a digit in the exponent");
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
    }
    const char* b = s_.data() + start;
    const char* e = s_.data() + pos_;
    Json v;
    v.type_ = Json::Type::Number;
    if (integral) {
      int64_t iv = 0;
      auto r = std::from_chars(b, e, iv);
      if (r.ec == std::errc() && r.ptr == e) {
        v.is_int_ = true;
        v.int_ = iv;
        v.num_ = static_cast<double>(iv);
        return v;
      }
      // Beyond int64: kept as a double (not integer).
    }
    double d = 0;
    auto r = std::from_chars(b, e, d);
    if (r.ec == std::errc::result_out_of_range) {
      // from_chars does not say overflow vs underflow; strtod does (the grammar was checked above, and
      // JSON numbers only use '.', which every C locale the host process might run under accepts here).
      const std::string tmp(b, e);
      d = std::strtod(tmp.c_str(), nullptr);
      if (std::isinf(d)) fail_at(start, str_cat("number ", tmp, " is out of the range of a double"));
    } else if (r.ec != std::errc() || r.ptr != e) {
      fail_at(start, "invalid number");
    }
    v.num_ = d;
    return v;
  }
};

Json Json::parse(const std::string& text, const std::string& source) {
  JsonParser p(text, source);
  return p.parse_document();
}

Json Json::parse_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) EXL2_FAIL(Io, path, ": cannot open file (", std::strerror(errno), ")");
  // Model JSON files (config, shard index) are kilobytes; the bound stops a device or a runaway file early.
  constexpr size_t kMaxJsonFileBytes = size_t(256) << 20;
  std::string text;
  char buf[1 << 16];
  size_t got;
  while (text.size() <= kMaxJsonFileBytes && (got = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, got);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) EXL2_FAIL(Io, path, ": read error");
  if (text.size() > kMaxJsonFileBytes)
    EXL2_FAIL(ModelFormat, path, ": larger than ", kMaxJsonFileBytes >> 20, " MiB; not a model's JSON file");
  return parse(text, path);
}

const char* Json::type_name() const {
  switch (type_) {
    case Type::Null:
      return "null";
    case Type::Bool:
      return "boolean";
    case Type::Number:
      return is_int_ ? "integer" : "number";
    case Type::String:
      return "string";
    case Type::Array:
      return "array";
    case Type::Object:
      return "object";
  }
  return "?";
}

bool Json::as_bool(const std::string& what) const {
  if (type_ != Type::Bool) EXL2_FAIL(ModelFormat, what, ": expected boolean, got ", type_name(), " ", excerpt(*this));
  return bool_;
}

double Json::as_double(const std::string& what) const {
  if (type_ != Type::Number) EXL2_FAIL(ModelFormat, what, ": expected number, got ", type_name(), " ", excerpt(*this));
  return is_int_ ? static_cast<double>(int_) : num_;
}

int64_t Json::as_int(const std::string& what) const {
  if (!is_integer()) EXL2_FAIL(ModelFormat, what, ": expected integer, got ", type_name(), " ", excerpt(*this));
  return int_;
}

const std::string& Json::as_string(const std::string& what) const {
  if (type_ != Type::String) EXL2_FAIL(ModelFormat, what, ": expected string, got ", type_name(), " ", excerpt(*this));
  return str_;
}

const std::vector<Json>& Json::as_array(const std::string& what) const {
  if (type_ != Type::Array) EXL2_FAIL(ModelFormat, what, ": expected array, got ", type_name(), " ", excerpt(*this));
  return arr_;
}

const std::vector<std::pair<std::string, Json>>& Json::as_object(const std::string& what) const {
  if (type_ != Type::Object) EXL2_FAIL(ModelFormat, what, ": expected object, got ", type_name(), " ", excerpt(*this));
  return obj_;
}

const Json* Json::find(const std::string& key) const {
  if (type_ != Type::Object) return nullptr;
  for (const auto& kv : obj_)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

size_t Json::size() const {
  if (type_ == Type::Array) return arr_.size();
  if (type_ == Type::Object) return obj_.size();
  return 0;
}

Json Json::make_bool(bool v) {
  Json j;
  j.type_ = Type::Bool;
  j.bool_ = v;
  return j;
}

Json Json::make_number(double v) {
  Json j;
  j.type_ = Type::Number;
  j.num_ = v;
  return j;
}

Json Json::make_int(int64_t v) {
  Json j;
  j.type_ = Type::Number;
  j.is_int_ = true;
  j.int_ = v;
  j.num_ = static_cast<double>(v);
  return j;
}

Json Json::make_string(std::string v) {
  Json j;
  j.type_ = Type::String;
  j.str_ = std::move(v);
  return j;
}

Json Json::make_array(std::vector<Json> v) {
  Json j;
  j.type_ = Type::Array;
  j.arr_ = std::move(v);
  return j;
}

Json Json::make_object(std::vector<std::pair<std::string, Json>> v) {
  Json j;
  j.type_ = Type::Object;
  j.obj_ = std::move(v);
  return j;
}

void Json::push_back(Json v) {
  EXL2_CHECK(type_ == Type::Array, "Json::push_back needs an array, this is ", type_name());
  arr_.push_back(std::move(v));
}

void Json::set(const std::string& key, Json v) {
  EXL2_CHECK(type_ == Type::Object, "Json::set needs an object, this is ", type_name());
  for (auto& kv : obj_) {
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  }
  obj_.emplace_back(key, std::move(v));
}

namespace {

void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += ch;  // strings built by the parser are valid UTF-8; builders' bytes are passed through
        }
    }
  }
  out += '"';
}

void dump_into(std::string& out, const Json& j) {
  switch (j.type()) {
    case Json::Type::Null:
      out += "null";
      break;
    case Json::Type::Bool:
      out += j.as_bool() ? "true" : "false";
      break;
    case Json::Type::Number: {
      if (j.is_integer()) {
        out += std::to_string(j.as_int());
        break;
      }
      const double d = j.as_double();
      if (!std::isfinite(d)) {
        out += "null";  // JSON has no NaN/Infinity
        break;
      }
      char buf[64];
      auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest round-trip form
      std::string s(buf, r.ptr);
      if (s.find_first_of(".eE") == std::string::npos) s += ".0";  // stays a non-integer on re-parse
      out += s;
      break;
    }
    case Json::Type::String:
      dump_string(out, j.as_string());
      break;
    case Json::Type::Array: {
      out += '[';
      bool first = true;
      for (const auto& v : j.as_array()) {
        if (!first) out += ',';
        first = false;
        dump_into(out, v);
      }
      out += ']';
      break;
    }
    case Json::Type::Object: {
      out += '{';
      bool first = true;
      for (const auto& kv : j.as_object()) {
        if (!first) out += ',';
        first = false;
        dump_string(out, kv.first);
        out += ':';
        dump_into(out, kv.second);
      }
      out += '}';
      break;
    }
  }
}

}  // namespace

std::string Json::dump() const {
  std::string out;
  dump_into(out, *this);
  return out;
}

}  // namespace exl2
