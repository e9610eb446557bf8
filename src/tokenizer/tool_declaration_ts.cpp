// TypeScript tool declarations (see tool_declaration_ts.h). The shape follows the Python encoder's
// two passes: JSON Schema → a small type tree (resolving $defs / $ref as it goes), then the tree →
// text. Both passes mirror where Python evaluates things lazily, because an exception anywhere
// (caught by the tokenizer) switches the whole declaration to JSON: a description that is not a
// string only raises if it is printed, so it is only checked where it would be printed.
#include "tokenizer/tool_declaration_ts.h"

#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "core/error.h"

namespace kd {
namespace {

using json = nlohmann::json;

constexpr const char* kIndent = "  ";

// The Python encoder raised: the template falls back to JSON.
struct PyRaise {
  std::string why;
};

// Python truthiness of a JSON value.
bool truthy(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return false;
    case json::value_t::boolean: return v.get<bool>();
    case json::value_t::number_integer: return v.get<int64_t>() != 0;
    case json::value_t::number_unsigned: return v.get<uint64_t>() != 0;
    case json::value_t::number_float: return v.get<double>() != 0.0;
    case json::value_t::string: return !v.get_ref<const std::string&>().empty();
    case json::value_t::array:
    case json::value_t::object: return !v.empty();
    default: return true;
  }
}

// str(v) for a scalar, as an f-string prints it; lists and objects would print their Python repr(),
// which we do not reproduce, so they are refused.
std::string py_str(const json& v, const std::string& where) {
  switch (v.type()) {
    case json::value_t::null: return "None";
    case json::value_t::boolean: return v.get<bool>() ? "True" : "False";
    case json::value_t::number_integer: return std::to_string(v.get<int64_t>());
    case json::value_t::number_unsigned: return std::to_string(v.get<uint64_t>());
    case json::value_t::number_float: return py_float_repr(v.get<double>());
    case json::value_t::string: return v.get<std::string>();
    default:
      fail("tools: ", where, ": a ", v.type_name(), " here would be printed with Python's repr(), which kdtree does not reproduce");
  }
}

// _format_description: every line prefixed with "// ", empty lines left empty.
std::string format_description(const std::string& text, const std::string& indent) {
  std::string out;
  size_t start = 0;
  while (true) {
    const size_t nl = text.find('\n', start);
    const std::string_view line = std::string_view(text).substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    if (!line.empty()) out += cat(indent, "// ", line);
    if (nl == std::string::npos) break;
    out += '\n';
    start = nl + 1;
  }
  return out;
}

// A description value as Python would format it: absent / falsy → nothing; a non-empty string →
// text; anything else truthy → `.split` raises.
std::optional<std::string> description_of(const json* d) {
  if (d == nullptr || !truthy(*d)) return std::nullopt;
  if (!d->is_string()) throw PyRaise{cat("a description is a ", d->type_name(), ", not a string")};
  return d->get<std::string>();
}

struct TsType;
using TypePtr = std::unique_ptr<TsType>;

struct Param {
  std::string name;
  TypePtr type;
  bool optional = true;
  const json* default_value = nullptr;  // null when absent or JSON null (Python skips None)
};

struct TsType {
  enum class Kind { scalar, object, array, enumeration, any_of, type_union, ref } kind = Kind::scalar;
  std::string where;                // JSON path, for errors
  const json* description = nullptr;
  std::vector<std::pair<std::string, const json*>> constraints;  // sorted by key (a std::map's order)
  std::string scalar;               // scalar: the JSON Schema type name
  std::vector<Param> properties;    // object
  enum class Extra { none, any, never, type, bad } extra = Extra::none;  // bad: Python raises when printing it
  TypePtr extra_type;               // object: additionalProperties as a schema
  TypePtr item;                     // array
  const json* enum_values = nullptr;
  std::vector<TypePtr> alternatives;  // anyOf
  std::vector<std::string> union_names;
  std::string ref_name;

  std::string docstring(const std::string& indent) const {
    std::string out;
    if (auto d = description_of(description)) out += format_description(*d, indent) + "\n";
    if (!constraints.empty()) {
      out += indent + "// ";
      for (size_t i = 0; i < constraints.size(); ++i) {
        if (i) out += ", ";
        out += cat(constraints[i].first, ": ", py_str(*constraints[i].second, where + "." + constraints[i].first));
      }
      out += "\n";
    }
    return out;
  }

  std::string render(const std::string& indent) const;
};

std::string render_param(const Param& p, const std::string& indent) {
  std::string out = p.type->docstring(indent);
  if (p.default_value != nullptr) {
    const json& d = *p.default_value;
    std::string repr;
    if (d.is_number() || d.is_boolean())
      repr = py_str(d, p.type->where + ".default");  // repr() of int/float/bool == str()
    else
      dump_python_json(d, repr);
    out += cat(indent, "// Default: ", repr, "\n");
  }
  return out + cat(indent, p.name, p.optional ? "?" : "", ": ", p.type->render(indent));
}

std::string TsType::render(const std::string& indent) const {
  switch (kind) {
    case Kind::scalar: return scalar == "integer" ? "number" : scalar;
    case Kind::ref: return ref_name;
    case Kind::type_union: {
      std::string out;
      for (size_t i = 0; i < union_names.size(); ++i) out += (i ? " | " : "") + union_names[i];
      return out;
    }
    case Kind::any_of: {
      std::string out;
      for (size_t i = 0; i < alternatives.size(); ++i) out += (i ? " | " : "") + alternatives[i]->render(indent);
      return out;
    }
    case Kind::enumeration: {
      std::string out;
      for (size_t i = 0; i < enum_values->size(); ++i) {
        const json& e = (*enum_values)[i];
        if (i) out += " | ";
        out += e.is_string() ? cat('"', e.get<std::string>(), '"') : py_str(e, cat(where, ".enum[", i, "]"));
      }
      return out;
    }
    case Kind::array: {
      const std::string inner = indent + kIndent;
      const std::string doc = item->docstring(inner);
      if (doc.empty()) return cat("Array<", item->render(indent), ">");
      return cat("Array<\n", doc, inner, item->render(inner), "\n", indent, ">");
    }
    case Kind::object: {
      // Required fields first, each group by name (the Python sort; names are unique keys).
      std::vector<const Param*> order;
      for (int pass = 0; pass < 2; ++pass) {
        std::vector<const Param*> group;
        for (const Param& p : properties)
          if (p.optional == (pass == 1)) group.push_back(&p);
        std::stable_sort(group.begin(), group.end(), [](const Param* a, const Param* b) { return a->name < b->name; });
        order.insert(order.end(), group.begin(), group.end());
      }
      const std::string inner = indent + kIndent;
      std::vector<std::string> fields;
      for (const Param* p : order) fields.push_back(render_param(*p, inner));
      if (extra == Extra::bad) throw PyRaise{"unknown additionalProperties at " + where};
      if (extra != Extra::none)
        fields.push_back(cat(inner, "[k: string]: ",
                             extra == Extra::any ? "any" : extra == Extra::never ? "never" : extra_type->render(inner)));
      if (fields.empty()) return "{}";
      std::string out = "{\n";
      for (size_t i = 0; i < fields.size(); ++i) out += (i ? ",\n" : "") + fields[i];
      return out + "\n" + indent + "}";
    }
  }
  return "";
}

// $defs seen so far, in the order Python's dict keeps them (first registration wins the position,
// the last one the value).
struct Registry {
  std::vector<std::pair<std::string, const json*>> defs;
  bool self_ref = false;

  void add(const json& d) {
    if (!truthy(d)) return;
    if (!d.is_object()) throw PyRaise{"$defs is not an object"};
    for (auto it = d.begin(); it != d.end(); ++it) {
      bool found = false;
      for (auto& [name, schema] : defs)
        if (name == it.key()) schema = &it.value(), found = true;
      if (!found) defs.emplace_back(it.key(), &it.value());
    }
  }
  const json* find(const std::string& name) const {
    for (const auto& [n, s] : defs)
      if (n == name) return s;
    return nullptr;
  }
};

const json* member(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

TypePtr parse_type(const json& schema, Registry& reg, const std::string& where, int depth);

// Schemas nest; tools come from API requests. Python's encoder would hit its recursion limit
// somewhere past a few hundred levels (and fall back to JSON); kdtree refuses past this many
// rather than guess where, and never recurses without bound.
constexpr int kMaxSchemaDepth = 64;

void take_constraints(TsType& t, const json& schema, std::initializer_list<const char*> keys) {
  for (auto it = schema.begin(); it != schema.end(); ++it)  // a std::map: already sorted by key
    for (const char* k : keys)
      if (it.key() == k) t.constraints.emplace_back(it.key(), &it.value());
}

TypePtr parse_object(const json& schema, Registry& reg, const std::string& where, int depth) {
  auto t = std::make_unique<TsType>();
  t->kind = TsType::Kind::object;
  t->where = where;
  if (!schema.is_object()) throw PyRaise{where + " is not an object"};
  t->description = member(schema, "description");
  if (schema.empty()) return t;
  if (const json* defs = member(schema, "$defs")) reg.add(*defs);
  if (const json* ap = member(schema, "additionalProperties"); ap != nullptr && !ap->is_null()) {
    if (ap->is_object()) {
      t->extra = TsType::Extra::type;
      t->extra_type = parse_type(*ap, reg, where + ".additionalProperties", depth + 1);
    } else if (ap->is_boolean()) {
      t->extra = ap->get<bool>() ? TsType::Extra::any : TsType::Extra::never;
    } else {
      t->extra = TsType::Extra::bad;
    }
  }
  const json* props = member(schema, "properties");
  if (props == nullptr) return t;
  if (!props->is_object()) throw PyRaise{where + ".properties is not an object"};
  std::vector<std::string> required;
  if (const json* req = member(schema, "required")) {
    if (req->is_null()) throw PyRaise{where + ".required is null"};
    if (!req->is_array()) fail("tools: ", where, ".required: expected an array of property names");
    for (const json& r : *req) {
      if (r.is_array() || r.is_object()) throw PyRaise{where + ".required holds an unhashable value"};
      if (r.is_string()) required.push_back(r.get<std::string>());
    }
  }
  for (auto it = props->begin(); it != props->end(); ++it) {
    Param p;
    p.name = it.key();
    p.type = parse_type(it.value(), reg, where + ".properties." + it.key(), depth + 1);
    p.optional = std::find(required.begin(), required.end(), p.name) == required.end();
    if (it.value().is_object())
      if (const json* d = member(it.value(), "default"); d != nullptr && !d->is_null()) p.default_value = d;
    t->properties.push_back(std::move(p));
  }
  return t;
}

TypePtr parse_type(const json& schema, Registry& reg, const std::string& where, int depth) {
  if (depth > kMaxSchemaDepth) fail("tools: ", where, ": JSON Schema nested deeper than ", kMaxSchemaDepth, " levels");
  if (schema.is_boolean()) {  // true: anything; false: Python logs a warning and says null
    auto t = std::make_unique<TsType>();
    t->where = where;
    t->scalar = schema.get<bool>() ? "any" : "null";
    return t;
  }
  if (!schema.is_object()) throw PyRaise{where + " is not a JSON Schema object"};
  auto t = std::make_unique<TsType>();
  t->where = where;
  t->description = member(schema, "description");
  if (const json* ref = member(schema, "$ref")) {
    t->kind = TsType::Kind::ref;
    if (!ref->is_string()) throw PyRaise{where + ".$ref is not a string"};
    const std::string r = ref->get<std::string>();
    if (r == "#") {
      reg.self_ref = true;
      t->ref_name = "parameters";
    } else if (r.rfind("#/$defs/", 0) == 0) {
      const std::string name = r.substr(r.rfind('/') + 1);
      const json* target = reg.find(name);
      if (target == nullptr) throw PyRaise{"reference not found: " + r};
      if (!target->is_object()) throw PyRaise{"$defs." + name + " is not an object"};
      if (const json* s = member(*target, "$self_ref"); s != nullptr && truthy(*s)) {
        t->ref_name = "parameters";  // only a schema that spells "$self_ref" itself gets here
      } else {
        t->ref_name = name;
      }
    } else {
      throw PyRaise{"unsupported reference format: " + r};
    }
    return t;
  }
  if (const json* any_of = member(schema, "anyOf")) {
    t->kind = TsType::Kind::any_of;
    if (any_of->is_array()) {
      for (size_t i = 0; i < any_of->size(); ++i)
        t->alternatives.push_back(parse_type((*any_of)[i], reg, cat(where, ".anyOf[", i, "]"), depth + 1));
    } else if (!((any_of->is_object() || any_of->is_string()) && !truthy(*any_of))) {
      throw PyRaise{where + ".anyOf is not a list"};  // an empty {} or "" iterates to nothing
    }
    return t;
  }
  if (const json* values = member(schema, "enum")) {
    t->kind = TsType::Kind::enumeration;
    if (!values->is_array()) fail("tools: ", where, ".enum: expected an array of values");
    t->enum_values = values;
    if (const json* typ = member(schema, "type")) {
      json declared = *typ;
      if (declared.is_array()) {
        if (declared.size() == 1) {
          declared = json(declared[0]);
        } else if (declared.size() == 2 && (declared[0] == "null" || declared[1] == "null")) {
          declared = json(declared[0] != "null" ? declared[0] : declared[1]);
        } else {
          throw PyRaise{"enum type list at " + where + " is not supported"};
        }
      }
      for (const json& v : *values) {
        if (v.is_null()) continue;
        const bool is_int = v.is_number_integer() || v.is_boolean();  // Python: bool is an int
        if ((declared == "string" && !v.is_string()) || (declared == "number" && !(is_int || v.is_number_float())) ||
            (declared == "integer" && !is_int) || (declared == "boolean" && !v.is_boolean()))
          throw PyRaise{"enum value does not match its type at " + where};
      }
    }
    return t;
  }
  if (const json* typ = member(schema, "type")) {
    if (typ->is_array()) {
      static const std::map<std::string, std::string> names = {
          {"string", "string"}, {"number", "number"}, {"integer", "number"}, {"boolean", "boolean"},
          {"null", "null"},     {"object", "{}"},     {"array", "Array<any>"}};
      t->kind = TsType::Kind::type_union;
      for (const json& n : *typ) {
        auto it = n.is_string() ? names.find(n.get<std::string>()) : names.end();
        if (it == names.end()) throw PyRaise{"unknown type in the type list at " + where};
        t->union_names.push_back(it->second);
      }
      return t;
    }
    if (!typ->is_string()) fail("tools: ", where, ".type: expected a string or a list of strings");
    const std::string name = typ->get<std::string>();
    if (name == "object") return parse_object(schema, reg, where, depth);
    if (name == "array") {
      t->kind = TsType::Kind::array;
      take_constraints(*t, schema, {"maxItems", "minItems"});
      const json* items = member(schema, "items");
      if (items != nullptr && truthy(*items)) {
        t->item = parse_type(*items, reg, where + ".items", depth + 1);
      } else {
        t->item = std::make_unique<TsType>();
        t->item->where = where + ".items";
        t->item->scalar = "any";
      }
      return t;
    }
    t->scalar = name;
    if (name == "string") take_constraints(*t, schema, {"maxLength", "minLength", "pattern"});
    if (name == "number" || name == "integer") take_constraints(*t, schema, {"maximum", "minimum"});
    return t;
  }
  if (schema.empty()) {
    t->scalar = "any";
    t->description = nullptr;
    return t;
  }
  throw PyRaise{"invalid JSON Schema object at " + where};
}

std::string function_to_ts(const json& fn, const std::string& where) {
  Registry reg;
  const json* params = member(fn, "parameters");
  static const json empty = json::object();
  const json& schema = params != nullptr && truthy(*params) ? *params : empty;
  TypePtr root = parse_object(schema, reg, where + ".parameters", 0);

  std::vector<std::string> interfaces;
  if (reg.self_ref) {  // the root becomes `interface parameters`, fields in key order, no extras
    std::string fields;
    for (size_t i = 0; i < root->properties.size(); ++i) fields += (i ? ",\n" : "") + render_param(root->properties[i], kIndent);
    interfaces.push_back(cat("interface parameters {", fields.empty() ? "" : "\n" + fields + "\n", "}"));
  }
  const auto snapshot = reg.defs;  // definitions found while parsing may add more; Python iterates a copy
  for (const auto& [name, def] : snapshot) {
    TypePtr t = parse_type(*def, reg, where + ".parameters.$defs." + name, 0);
    const std::string body = t->render("");
    if (!def->is_object()) throw PyRaise{"$defs." + name + " is not an object"};
    std::string desc;
    if (auto d = description_of(member(*def, "description"))) desc = format_description(*d, "") + "\n";
    interfaces.push_back(cat(desc, "interface ", name, " ", body));
  }
  std::string name = "function";
  if (const json* n = member(fn, "name")) name = py_str(*n, where + ".name");
  const std::string type_def =
      cat("type ", name, " = (_: ", reg.self_ref ? std::string("parameters") : root->render(""), ") => any;");

  std::vector<std::string> parts;
  std::string joined;
  for (size_t i = 0; i < interfaces.size(); ++i) joined += (i ? "\n" : "") + interfaces[i];
  if (!joined.empty()) parts.push_back(joined);
  if (const json* d = member(fn, "description"); d != nullptr && truthy(*d)) {
    if (!d->is_string()) throw PyRaise{where + ".description is not a string"};
    std::string text = format_description(d->get<std::string>(), "");
    if (!text.empty()) parts.push_back(text);
  }
  parts.push_back(type_def);
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "\n" : "") + parts[i];
  return out;
}

}  // namespace

std::string py_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  if (v == 0.0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);  // shortest round-trip
  std::string s(buf, res.ptr);
  std::string sign;
  if (s[0] == '-') sign = "-", s.erase(0, 1);
  const size_t e = s.find('e');
  const int exp10 = std::stoi(s.substr(e + 1));
  std::string digits = s.substr(0, e);
  if (digits.size() > 1) digits.erase(1, 1);  // drop the '.'
  const int decpt = exp10 + 1;  // digits d1 d2 ... with the point after decpt of them
  const int n = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {  // Python's repr switches to exponent notation here
    std::string out = sign + digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int x = decpt - 1;
    out += x < 0 ? "e-" : "e+";
    const std::string xs = std::to_string(std::abs(x));
    return out + (xs.size() < 2 ? "0" : "") + xs;
  }
  if (decpt <= 0) return sign + "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  if (decpt >= n) return sign + digits + std::string(static_cast<size_t>(decpt - n), '0') + ".0";
  return sign + digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
}

namespace {

template <class J>
void dump_nested(const J& v, std::string& out, const char* item_sep, const char* key_sep, int depth) {
  // Python's json.dumps stops at its recursion limit too; values this deep are not worth guessing.
  if (depth > 256) fail("a JSON value nested deeper than 256 levels (tools or tool-call arguments)");
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out += item_sep;
      first = false;
      out += J(it.key()).dump(-1, ' ', false);
      out += key_sep;
      dump_nested(it.value(), out, item_sep, key_sep, depth + 1);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) out += item_sep;
      dump_nested(v[i], out, item_sep, key_sep, depth + 1);
    }
    out += ']';
  } else if (v.is_number_float()) {
    out += py_float_repr(v.template get<double>());
  } else {
    out += v.dump(-1, ' ', false);  // strings: the same escapes as json.dumps(ensure_ascii=False)
  }
}

}  // namespace

void dump_python_json(const json& v, std::string& out, const char* item_sep, const char* key_sep) {
  dump_nested(v, out, item_sep, key_sep, 0);
}

void dump_python_json(const nlohmann::ordered_json& v, std::string& out, const char* item_sep, const char* key_sep) {
  dump_nested(v, out, item_sep, key_sep, 0);
}

void check_json_integers(std::string_view t, const char* what) {
  bool in_string = false;
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      continue;
    }
    if (c != '-' && (c < '0' || c > '9')) continue;
    const size_t start = i;
    bool integral = true;
    while (i < t.size() && std::string_view("0123456789+-.eE").find(t[i]) != std::string_view::npos) {
      if (t[i] == '.' || t[i] == 'e' || t[i] == 'E') integral = false;
      ++i;
    }
    std::string_view num = t.substr(start, i - start);
    --i;
    if (!integral) continue;
    const bool neg = !num.empty() && num[0] == '-';
    if (neg) num.remove_prefix(1);
    while (num.size() > 1 && num[0] == '0') num.remove_prefix(1);
    const std::string_view limit = neg ? "9223372036854775808" : "18446744073709551615";
    if (num.size() > limit.size() || (num.size() == limit.size() && num > limit))
      fail(what, ": the integer ", neg ? "-" : "", num.substr(0, 40), " does not fit in 64 bits (Python would print it exactly; "
           "kdtree would not), write it as a string or a float");
  }
}

std::optional<std::string> encode_tools_typescript(const json& tools, std::string* why) {
  try {
    std::vector<std::string> functions;
    for (size_t i = 0; i < tools.size(); ++i) {
      const json& tool = tools[i];
      const std::string where = cat("tools[", i, "]");
      if (!tool.is_object()) throw PyRaise{where + " is not an object"};
      const json* type = member(tool, "type");
      if (type == nullptr || *type != "function") continue;  // other tool types are skipped
      const json* fn = member(tool, "function");
      if (fn == nullptr || !truthy(*fn)) continue;
      if (!fn->is_object()) throw PyRaise{where + ".function is not an object"};
      functions.push_back(function_to_ts(*fn, where + ".function"));
    }
    if (functions.empty()) return std::string();
    std::string out = "# Tools\n\n## functions\nnamespace functions {\n";
    for (size_t i = 0; i < functions.size(); ++i) out += (i ? "\n" : "") + functions[i];
    return out + "\n}\n";
  } catch (const PyRaise& e) {
    if (why != nullptr) *why = e.why;
    return std::nullopt;
  }
}

}  // namespace kd
