// A strict JSON reader (RFC 8259): the whole input must be one value, UTF-8 validated, no trailing
// commas, comments, NaN or duplicate keys. Errors are ModelFormatError naming `source` and the byte offset.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace exl2 {

class Json {
 public:
  enum class Type { Null, Bool, Number, String, Array, Object };

  Json() = default;  // null
  static Json parse(const std::string& text, const std::string& source = "<json>");
  static Json parse_file(const std::string& path);

  Type type() const { return type_; }
  const char* type_name() const;
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_number() const { return type_ == Type::Number; }
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }
  // True when the number was written without fraction or exponent and fits int64.
  bool is_integer() const { return type_ == Type::Number && is_int_; }

  // Typed accessors throw ModelFormatError "<what>: expected <type>, got <type>".
  bool as_bool(const std::string& what = "value") const;
  double as_double(const std::string& what = "value") const;
  int64_t as_int(const std::string& what = "value") const;
  const std::string& as_string(const std::string& what = "value") const;
  const std::vector<Json>& as_array(const std::string& what = "value") const;
  // Object members in file order.
  const std::vector<std::pair<std::string, Json>>& as_object(const std::string& what = "value") const;

  // Object lookup: nullptr when absent (or when this is not an object).
  const Json* find(const std::string& key) const;
  bool contains(const std::string& key) const { return find(key) != nullptr; }
  size_t size() const;  // array or object length

  // Builders (used by writers and tests).
  static Json make_null() { return Json(); }
  static Json make_bool(bool v);
  static Json make_number(double v);
  static Json make_int(int64_t v);
  static Json make_string(std::string v);
  static Json make_array(std::vector<Json> v = {});
  static Json make_object(std::vector<std::pair<std::string, Json>> v = {});
  void push_back(Json v);                 // arrays
  void set(const std::string& key, Json v);  // objects (replaces an existing key)
  std::string dump() const;               // compact serialization

 private:
  friend class JsonParser;
  Type type_ = Type::Null;
  bool bool_ = false;
  bool is_int_ = false;
  double num_ = 0;
  int64_t int_ = 0;
  std::string str_;
  std::vector<Json> arr_;
  std::vector<std::pair<std::string, Json>> obj_;
};

}  // namespace exl2
