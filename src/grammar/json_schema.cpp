#include "grammar/json_schema.h"

// GCC 12 reports -Wrestrict on std::string concatenation at -O3 (a false positive, GCC bug 105329).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/gbnf.h"
#include "grammar/json_format.h"
#include "grammar/json_number.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"

namespace kd::grammar {

namespace {

using json = nlohmann::ordered_json;

// A GBNF string literal holding `bytes` (UTF-8 passes through; quotes, backslashes and control
// characters are escaped).
std::string gbnf_literal(const std::string& bytes) {
  std::string out = "\"";
  for (unsigned char c : bytes) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c < 0x20 || c == 0x7F) {
      static const char* hex = "0123456789ABCDEF";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += char(c);
    }
  }
  return out + "\"";
}

// The JSON text of a value with the grammar's separators (enum and const values).
std::string serialize(const json& v, const JsonGrammarOptions& o) {
  const std::string is = o.any_whitespace ? ", " : o.item_separator, ks = o.any_whitespace ? ": " : o.key_separator;
  if (v.is_object()) {
    std::string s = "{";
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) s += is;
      first = false;
      s += json(it.key()).dump(-1, ' ', false) + ks + serialize(it.value(), o);
    }
    return s + "}";
  }
  if (v.is_array()) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? is : "") + serialize(v[i], o);
    return s + "]";
  }
  return v.dump(-1, ' ', false);
}

// Keywords that constrain one JSON type, by type (the rest apply to every value).
const std::map<std::string, std::string>& typed_keywords() {
  static const std::map<std::string, std::string> t = {
      {"properties", "object"},   {"required", "object"},    {"additionalProperties", "object"},
      {"items", "array"},         {"prefixItems", "array"},  {"minItems", "array"},  {"additionalItems", "array"},
      {"maxItems", "array"},      {"uniqueItems", "array"},  {"minLength", "string"},
      {"maxLength", "string"},    {"pattern", "string"},     {"format", "string"},
      {"minimum", "number"},      {"maximum", "number"},     {"exclusiveMinimum", "number"},
      {"exclusiveMaximum", "number"}, {"multipleOf", "number"}};
  return t;
}

const std::set<std::string>& known_keywords() {
  static const std::set<std::string> k = [] {
    std::set<std::string> s = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"};
    for (const auto& [name, type] : typed_keywords()) s.insert(name);
    return s;
  }();
  return k;
}

// One bit per JSON type a value may have (integers are numbers).
enum : unsigned { kNull = 1, kBool = 2, kObject = 4, kArray = 8, kString = 16, kNumber = 32, kAll = 63 };

unsigned type_bit(const std::string& t) {
  return t == "null" ? kNull : t == "boolean" ? kBool : t == "object" ? kObject : t == "array" ? kArray : t == "string" ? kString
         : t == "number" || t == "integer" ? kNumber : kAll;
}

unsigned value_bit(const json& v) {
  return v.is_null() ? kNull : v.is_boolean() ? kBool : v.is_object() ? kObject : v.is_array() ? kArray : v.is_string() ? kString : kNumber;
}

// Tests texts against one grammar (enum values against their sibling keywords): one matcher for all
// of them, so they share its memo and its work budget — N values cost one grammar, not N matchers
// (each with a fresh budget) — and a grammar past the matcher's limits is a LimitError (a 400).
class GrammarTest {
 public:
  explicit GrammarTest(const Grammar& g) : m_(std::make_shared<const CompiledGrammar>(g), bytes_vocab(), {}) {}
  bool accepts(const std::string& bytes) {
    const Matcher::State st = m_.advance_bytes(m_.state(), bytes);
    return st != Matcher::kDead && m_.accepting(st);
  }

 private:
  static std::shared_ptr<const VocabTrie> bytes_vocab() {
    static const std::shared_ptr<const VocabTrie> v = [] {
      std::vector<std::string> b;
      for (int i = 0; i < 256; ++i) b.push_back(std::string(1, char(i)));
      return std::make_shared<const VocabTrie>(b, std::vector<bool>(256, false));
    }();
    return v;
  }
  Matcher m_;
};

const std::set<std::string>& annotations() {
  static const std::set<std::string> a = {"title", "description", "default", "examples", "$schema", "$id",
                                          "$comment", "deprecated", "readOnly", "writeOnly", "$defs", "definitions"};
  return a;
}

class Converter {
 public:
  Converter(const json& root, const JsonGrammarOptions& o) : root_(root), o_(o) {
    if (o.any_whitespace) {
      ws_ = "ws";
      comma_ = "ws \",\" ws";
      colon_ = "ws \":\" ws";
    } else {
      ws_ = "";
      comma_ = gbnf_literal(o.item_separator);
      colon_ = gbnf_literal(o.key_separator);
    }
  }

  std::string run() {
    const std::string top = visit(root_, "$");
    std::string out = "root ::= " + top + "\n";
    for (const auto& [name, body] : rules_) out += name + " ::= " + body + "\n";
    return out;
  }

  std::string any_object() {
    const std::string r = any_value_rules();
    (void)r;
    return "root ::= json-object\n" + emit_rules();
  }

 private:
  const json& root_;
  JsonGrammarOptions o_;
  std::string ws_, comma_, colon_;
  std::map<std::string, std::string> rules_;  // name → body
  std::map<std::string, std::string> refs_;   // $ref → rule name
  int64_t shape_calls_ = 0;                   // work done by shape() (oneOf's disjointness test)
  int n_ = 0;

  std::string emit_rules() {
    std::string out;
    for (const auto& [name, body] : rules_) out += name + " ::= " + body + "\n";
    return out;
  }

  std::string add(const std::string& base, const std::string& body) {
    const std::string name = cat(base, "-", ++n_);
    rules_[name] = body;
    return name;
  }

  std::string w(const std::string& s) const { return ws_.empty() ? s : s.empty() ? ws_ : s; }

  void basic_rules() {
    if (rules_.count("json-string")) return;
    if (o_.any_whitespace) rules_["ws"] = "[ \\n\\r\\t]*";
    rules_["json-char"] = "[^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})";
    rules_["json-string"] = "\"\\\"\" json-char* \"\\\"\"";
    rules_["json-integer"] = "\"0\" | \"-\"? [1-9] [0-9]*";
    rules_["json-number"] = "\"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [+-]? [0-9]+)?";
    rules_["json-boolean"] = "\"true\" | \"false\"";
    rules_["json-null"] = "\"null\"";
  }

  std::string any_value_rules() {
    basic_rules();
    if (!rules_.count("json-value")) {
      const std::string open_o = ws_.empty() ? "\"{\"" : "\"{\" ws", close_o = ws_.empty() ? "\"}\"" : "ws \"}\"";
      const std::string open_a = ws_.empty() ? "\"[\"" : "\"[\" ws", close_a = ws_.empty() ? "\"]\"" : "ws \"]\"";
      rules_["json-value"] = "json-object | json-array | json-string | json-number | json-boolean | json-null";
      rules_["json-member"] = "json-string " + colon_ + " json-value";
      rules_["json-object"] = open_o + " (json-member (" + comma_ + " json-member)*)? " + close_o;
      rules_["json-array"] = open_a + " (json-value (" + comma_ + " json-value)*)? " + close_a;
    }
    return "json-value";
  }

  [[noreturn]] void unsupported(const std::string& path, const std::string& what) const {
    fail(path, ": ", what);
  }

  const json& resolve(const std::string& ref, const std::string& path) const {
    if (ref.empty() || ref[0] != '#') unsupported(path + ".$ref", "only references inside the document (\"#…\") are supported");
    try {
      const json::json_pointer ptr(ref.substr(1));
      if (!root_.contains(ptr)) unsupported(path + ".$ref", cat("'", ref, "' points at nothing"));
      return root_.at(ptr);
    } catch (const json::exception&) {
      unsupported(path + ".$ref", cat("'", ref.substr(0, 80), "' is not a JSON pointer"));
    }
  }

  std::string visit(const json& s, const std::string& path, int depth = 0) {
    if (depth > 64) unsupported(path, "schema nested deeper than 64 levels");
    if (s.is_boolean()) {
      if (!s.get<bool>()) unsupported(path, "the schema 'false' matches nothing");
      return any_value_rules();
    }
    if (!s.is_object()) unsupported(path, "a schema must be an object or a boolean");
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string& k = it.key();
      if (known_keywords().count(k) || annotations().count(k) || k.rfind("x-", 0) == 0) continue;
      if (k == "not") unsupported(path + ".not", "not supported (a grammar cannot take the complement of a schema)");
      if (k == "if" || k == "then" || k == "else")
        unsupported(path + "." + k, "not supported (conditional schemas: the grammar cannot test a value before writing it)");
      unsupported(path + "." + k, "not supported");
    }
    if (s.contains("$ref")) {
      if (s.size() > 1)
        for (auto it = s.begin(); it != s.end(); ++it)
          if (it.key() != "$ref" && !annotations().count(it.key()))
            unsupported(path + "." + it.key(), "keywords beside $ref are not supported");
      if (!s["$ref"].is_string()) unsupported(path + ".$ref", "must be a string");
      const std::string ref = s["$ref"];
      if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
      const std::string name = cat("ref-", ++n_);
      refs_[ref] = name;
      rules_[name] = "";  // reserved: a recursive reference sees the name
      rules_[name] = visit(resolve(ref, path), path + ".$ref", depth + 1);
      return name;
    }
    if (s.contains("const") || s.contains("enum")) return enumeration(s, path, depth);
    for (const char* k : {"anyOf", "oneOf"})
      if (s.contains(k)) {
        const json& a = s[k];
        if (!a.is_array() || a.empty()) unsupported(path + "." + k, "must be a non-empty array");
        json base = s;
        base.erase(k);
        // oneOf is anyOf exactly when no value can match two branches; otherwise "exactly one"
        // would need the grammar to test a value against every branch, which it cannot.
        if (std::string(k) == "oneOf") check_disjoint(a, base, path, depth);
        std::string alts;
        for (size_t i = 0; i < a.size(); ++i) {
          if (a[i] == json(false)) continue;  // matches nothing: no alternative
          // Keywords beside anyOf apply to every branch (JSON Schema's "and").
          json branch = a[i];
          if (branch.is_object())
            for (auto it = base.begin(); it != base.end(); ++it)
              if (!annotations().count(it.key()) && !branch.contains(it.key())) branch[it.key()] = it.value();
          alts += (alts.empty() ? "" : " | ") + visit(branch, cat(path, ".", k, "[", i, "]"), depth + 1);
        }
        if (alts.empty()) unsupported(path + "." + k, "every branch is 'false': the schema matches nothing");
        return add("any-of", alts);
      }
    if (s.contains("allOf")) {
      const json& a = s["allOf"];
      if (!a.is_array() || a.size() != 1) unsupported(path + ".allOf", "only an allOf of one schema is supported");
      return visit(a[0], path + ".allOf[0]", depth + 1);
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t);
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) unsupported(path + ".type", "must be a string or an array of strings");
          types.push_back(x);
        }
      } else {
        unsupported(path + ".type", "must be a string or a non-empty array of strings");
      }
    } else {
      // No type: every JSON value, each type under the keywords that apply to it (JSON Schema's
      // meaning: {"minLength": 2} also accepts 7 and null).
      bool typed = false;
      for (auto it = s.begin(); it != s.end(); ++it) typed = typed || typed_keywords().count(it.key());
      if (!typed) return any_value_rules();
      types = {"null", "boolean", "object", "array", "string", "number"};
    }
    std::string alts;
    for (const std::string& t : types) alts += (alts.empty() ? "" : " | ") + visit_type(s, t, path, depth);
    return types.size() == 1 ? alts : add("types", alts);
  }

  std::string visit_type(const json& s, const std::string& t, const std::string& path, int depth) {
    basic_rules();
    // Keywords of another type: an error beside a single type (a likely mistake), ignored beside a
    // list or no type (JSON Schema: they constrain only values of their own type).
    const std::string family = t == "integer" ? "number" : t;
    for (auto it = s.begin(); it != s.end(); ++it) {
      auto k = typed_keywords().find(it.key());
      if (k != typed_keywords().end() && k->second != family && s.contains("type") && s["type"].is_string())
        unsupported(path + "." + it.key(), cat("does not apply to type '", t, "'"));
    }
    if (t == "null") return "json-null";
    if (t == "boolean") return "json-boolean";
    if (t == "integer" || t == "number") return number(s, t == "integer", path);
    if (t == "string") {
      std::string format;
      if (s.contains("format")) {
        if (!s["format"].is_string()) unsupported(path + ".format", "must be a string");
        const auto re = format_regex(s["format"].get<std::string>());
        if (!re)
          unsupported(path + ".format", cat("format '", s["format"].get<std::string>().substr(0, 40), "' is not supported (supported: ",
                                             supported_formats(), ")"));
        if (s.contains("pattern")) unsupported(path + ".format", "format together with pattern is not supported");
        format = *re;
      }
      if (s.contains("pattern") || !format.empty()) {
        const std::string key = format.empty() ? "pattern" : "format";
        if (s.contains("minLength") || s.contains("maxLength"))
          unsupported(path + "." + key, cat(key, " together with minLength/maxLength is not supported (the grammar would have to count "
                                             "characters inside the regular expression)"));
        if (format.empty() && !s["pattern"].is_string()) unsupported(path + ".pattern", "must be a string");
        const std::string re = format.empty() ? s["pattern"].get<std::string>() : format;
        return add(key, "\"\\\"\" " + regex_to_gbnf(re, true, path + "." + key) + " \"\\\"\"");
      }
      const int64_t lo = count(s, "minLength", path, 0), hi = count(s, "maxLength", path, -1);
      if (hi >= 0 && hi < lo) unsupported(path + ".maxLength", "is below minLength");
      if (lo == 0 && hi < 0) return "json-string";
      return add("string", cat("\"\\\"\" json-char{", lo, ",", hi < 0 ? std::string() : std::to_string(hi), "} \"\\\"\""));
    }
    if (t == "array") {
      const int64_t lo = count(s, "minItems", path, 0), hi = count(s, "maxItems", path, -1);
      if (hi >= 0 && hi < lo) unsupported(path + ".maxItems", "is below minItems");
      // The items: a prefix of schemas by position (prefixItems, or draft 4–7's array form of
      // items), then `item` for the rest (items, or additionalItems beside an items array; any
      // value by default) unless `more` is false.
      std::vector<std::string> prefix;
      const bool tuple = s.contains("items") && s["items"].is_array();
      const char* prefix_key = tuple ? "items" : "prefixItems";
      if (s.contains(prefix_key)) {
        const json& p = s[prefix_key];
        if (!p.is_array()) unsupported(path + ".prefixItems", "must be an array");
        for (size_t i = 0; i < p.size(); ++i) prefix.push_back(visit(p[i], cat(path, ".", prefix_key, "[", i, "]"), depth + 1));
      }
      const char* rest_key = tuple ? "additionalItems" : "items";
      std::string item;
      bool more = true;
      if (s.contains(rest_key)) {
        if (s[rest_key].is_boolean() && !s[rest_key].get<bool>()) more = false;
        else item = visit(s[rest_key], path + "." + rest_key, depth + 1);
      } else {
        item = any_value_rules();
      }
      const int64_t n_prefix = int64_t(prefix.size());
      if (!more && lo > n_prefix) unsupported(path + ".minItems", cat("is above the ", n_prefix, " items the schema allows"));
      if (s.contains("uniqueItems")) {
        if (!s["uniqueItems"].is_boolean()) unsupported(path + ".uniqueItems", "must be a boolean");
        // Distinct items are a grammar only when at most one item can appear.
        const bool at_most_one = (hi >= 0 && hi <= 1) || (!more && n_prefix <= 1);
        if (s["uniqueItems"].get<bool>() && !at_most_one)
          unsupported(path + ".uniqueItems", "true is supported only with maxItems ≤ 1 (a grammar cannot compare items with each other)");
      }
      const std::string open = ws_.empty() ? "\"[\"" : "\"[\" ws", close = ws_.empty() ? "\"]\"" : "ws \"]\"";
      // rest(i): what may follow once i ≥ 1 items are written (lo ≤ count ≤ hi).
      std::function<std::string(int64_t)> rest = [&](int64_t i) -> std::string {
        if ((hi >= 0 && i >= hi) || (i >= n_prefix && !more)) return "";
        if (i >= n_prefix)
          return cat("(", comma_, " ", item, "){", std::max<int64_t>(lo - i, 0), ",", hi < 0 ? std::string() : std::to_string(hi - i), "}");
        const std::string seq = comma_ + " " + prefix[size_t(i)] + " " + rest(i + 1);
        return i < lo ? seq : "(" + seq + ")?";
      };
      if (hi == 0 || (n_prefix == 0 && !more)) return add("array", open + " " + close);
      const std::string first = (n_prefix > 0 ? prefix[0] : item) + " " + rest(1);
      return add("array", open + " " + (lo > 0 ? first : "(" + first + ")?") + " " + close);
    }
    if (t == "object") return object(s, path, depth);
    unsupported(path + ".type", cat("unknown type '", t.substr(0, 40), "'"));
  }

  // enum / const: the listed values, less those the sibling keywords (type, minimum, …) reject —
  // each is checked against the grammar of the schema without enum and const.
  std::string enumeration(const json& s, const std::string& path, int depth) {
    std::vector<json> values;
    const std::string key = s.contains("enum") ? "enum" : "const";
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) unsupported(path + ".enum", "must be a non-empty array");
      for (const json& v : e)
        if (!s.contains("const") || v == s["const"]) values.push_back(v);
    } else {
      values.push_back(s["const"]);
    }
    json rest = s;
    rest.erase("enum");
    rest.erase("const");
    bool constrained = false;
    for (auto it = rest.begin(); it != rest.end(); ++it) constrained = constrained || !(annotations().count(it.key()) || it.key().rfind("x-", 0) == 0);
    std::optional<GrammarTest> check;
    if (constrained) {
      Converter c(root_, o_);
      const std::string top = c.visit(rest, path, depth + 1);
      check.emplace(parse_gbnf("root ::= " + top + "\n" + c.emit_rules()));
    }
    std::string alts;
    for (const json& v : values) {
      const std::string text = serialize(v, o_);
      if (check && !check->accepts(text)) continue;
      alts += (alts.empty() ? "" : " | ") + gbnf_literal(text);
    }
    if (alts.empty()) unsupported(path + "." + key, "no value satisfies the schema's other keywords");
    return add("enum", alts);
  }

  // What oneOf's disjointness test knows of a schema: the JSON types it admits, its values when it
  // is an enum or const, and (for objects) required properties whose value is a const or enum.
  struct Shape {
    unsigned types = kAll;
    std::optional<std::vector<json>> values;
    std::map<std::string, std::vector<json>> tags;
  };

  Shape shape(const json& schema, const std::string& path, int depth) {
    const json* s = &schema;
    for (int hops = 0; s->is_object() && s->contains("$ref") && (*s)["$ref"].is_string() && hops < 16; ++hops)
      s = &resolve((*s)["$ref"].get<std::string>(), path);
    Shape sh;
    if (s->is_boolean()) {
      sh.types = s->get<bool>() ? unsigned(kAll) : 0u;
      return sh;
    }
    // A bounded amount of work: recursive $refs under anyOf could otherwise branch without end
    // (knowing less only makes branches look less disjoint).
    if (!s->is_object() || depth > 16 || ++shape_calls_ > 10000) return sh;
    if (s->contains("type")) {
      const json& t = (*s)["type"];
      unsigned m = 0;
      if (t.is_string()) m = type_bit(t.get<std::string>());
      else if (t.is_array())
        for (const json& x : t) m |= x.is_string() ? type_bit(x.get<std::string>()) : unsigned(kAll);
      sh.types = m ? m : unsigned(kAll);
    }
    if (s->contains("const")) sh.values = std::vector<json>{(*s)["const"]};
    else if (s->contains("enum") && (*s)["enum"].is_array()) sh.values = (*s)["enum"].get<std::vector<json>>();
    if (sh.values) {
      unsigned m = 0;
      for (const json& v : *sh.values) m |= value_bit(v);
      sh.types &= m;
    }
    for (const char* k : {"anyOf", "oneOf"})
      if (s->contains(k) && (*s)[k].is_array()) {
        unsigned m = 0;
        for (const json& b : (*s)[k]) m |= shape(b, path, depth + 1).types;
        sh.types &= m;
      }
    if (s->contains("allOf") && (*s)["allOf"].is_array())
      for (const json& b : (*s)["allOf"]) sh.types &= shape(b, path, depth + 1).types;
    if (sh.types == kObject && s->contains("properties") && (*s)["properties"].is_object() && s->contains("required") &&
        (*s)["required"].is_array())
      for (const json& r : (*s)["required"])
        if (r.is_string() && (*s)["properties"].contains(r.get<std::string>())) {
          const Shape p = shape((*s)["properties"][r.get<std::string>()], path, depth + 1);
          if (p.values) sh.tags[r.get<std::string>()] = *p.values;
        }
    return sh;
  }

  static bool disjoint(const Shape& a, const Shape& b) {
    if (!(a.types & b.types)) return true;
    auto apart = [](const std::vector<json>& x, const std::vector<json>& y) {
      for (const json& u : x)
        for (const json& v : y)
          if (u == v) return false;
      return true;
    };
    if (a.values && b.values && apart(*a.values, *b.values)) return true;
    if (a.types == kObject && b.types == kObject)
      for (const auto& [k, vals] : a.tags)
        if (auto it = b.tags.find(k); it != b.tags.end() && apart(vals, it->second)) return true;
    return false;
  }

  void check_disjoint(const json& branches, const json& base, const std::string& path, int depth) {
    std::vector<Shape> shapes;
    for (const json& b : branches) {
      json merged = b;
      if (merged.is_object())
        for (auto it = base.begin(); it != base.end(); ++it)
          if (!annotations().count(it.key()) && !merged.contains(it.key())) merged[it.key()] = it.value();
      shapes.push_back(shape(merged, path + ".oneOf", depth + 1));
    }
    for (size_t i = 0; i < shapes.size(); ++i)
      for (size_t j = i + 1; j < shapes.size(); ++j)
        if (!disjoint(shapes[i], shapes[j]))
          unsupported(path + ".oneOf", cat("branches ", i, " and ", j, " may both match one value, and a grammar cannot enforce "
                                           "'exactly one' (oneOf is exact for branches of different types, with distinct enum/const "
                                           "values, or objects told apart by a required const property); use anyOf if a value may match both"));
  }

  // integer / number with minimum, maximum, exclusiveMinimum, exclusiveMaximum (draft 4's boolean
  // form too) and multipleOf: grammar/json_number.h.
  std::string number(const json& s, bool integer, const std::string& path) {
    auto num = [&](const char* k) -> const json* {
      if (!s.contains(k)) return nullptr;
      if (!s[k].is_number() && !(s[k].is_boolean() && std::string(k).rfind("exclusive", 0) == 0))
        unsupported(path + "." + k, "must be a number");
      return &s[k];
    };
    const json *mn = num("minimum"), *mx = num("maximum"), *emn = num("exclusiveMinimum"), *emx = num("exclusiveMaximum");
    // Draft 4: exclusiveMinimum: true makes minimum exclusive.
    const bool mn_excl = emn && emn->is_boolean() && emn->get<bool>(), mx_excl = emx && emx->is_boolean() && emx->get<bool>();
    if (emn && emn->is_boolean()) emn = nullptr;
    if (emx && emx->is_boolean()) emx = nullptr;
    const json* mult = num("multipleOf");
    if (mult && !(mult->get<double>() > 0)) unsupported(path + ".multipleOf", "must be greater than 0");
    const bool bounded = mn || mx || emn || emx;
    if (!integer) {
      if (mult) unsupported(path + ".multipleOf", "not supported for type number (it is for type integer)");
      if (emn || mn_excl || emx || mx_excl)
        unsupported(path + (emn || mn_excl ? ".exclusiveMinimum" : ".exclusiveMaximum"),
                    "not supported for type number (a decimal just past the bound can round onto it as a double); use minimum/maximum, "
                    "or type integer");
      if (!bounded) return "json-number";
      auto bound = [&](const json* v, const char* k) -> std::optional<double> {
        if (!v) return std::nullopt;
        if (v->is_number_integer() && std::fabs(v->get<double>()) > 9007199254740992.0)
          unsupported(path + "." + k, "integer bounds beyond ±2^53 are not supported for type number");
        return v->get<double>();
      };
      const auto lo = bound(mn, "minimum"), hi = bound(mx, "maximum");
      if (lo && hi && *lo > *hi) unsupported(path + ".maximum", "is below minimum: no number satisfies both");
      return add("number", number_range_gbnf(lo, hi, path + (lo ? ".minimum" : ".maximum")));
    }
    // The least integer ≥ v (> v when strict), the greatest ≤ v (< v).
    auto whole = [&](const json& v, bool up, bool strict, const char* k) -> i128 {
      if (v.is_number_integer()) {
        const i128 x = v.is_number_unsigned() ? i128(v.get<uint64_t>()) : i128(v.get<int64_t>());
        return strict ? (up ? x + 1 : x - 1) : x;
      }
      const double d = v.get<double>();
      if (!(std::fabs(d) < 1e19)) unsupported(path + "." + k, "bounds beyond ±1e19 are not supported");
      const double r = up ? std::ceil(d) : std::floor(d);
      i128 x = i128(r);
      if (strict && r == d) x += up ? 1 : -1;
      return x;
    };
    IntRange r;
    auto tighten = [](std::optional<i128>& b, i128 v, bool lower) { b = !b ? v : lower ? std::max(*b, v) : std::min(*b, v); };
    if (mn) tighten(r.lo, whole(*mn, true, mn_excl, "minimum"), true);
    if (emn) tighten(r.lo, whole(*emn, true, true, "exclusiveMinimum"), true);
    if (mx) tighten(r.hi, whole(*mx, false, mx_excl, "maximum"), false);
    if (emx) tighten(r.hi, whole(*emx, false, true, "exclusiveMaximum"), false);
    if (r.lo && r.hi && *r.lo > *r.hi)
      unsupported(path + (mx ? ".maximum" : ".exclusiveMaximum"), "leaves no integer above the lower bound");
    if (mult) {
      const double k = mult->get<double>();
      if (std::floor(k) != k) unsupported(path + ".multipleOf", "only an integer multipleOf is supported for type integer");
      if (k > double(kMaxModulus)) unsupported(path + ".multipleOf", cat("values above ", kMaxModulus, " are not supported"));
      if (k != 1) {
        if (bounded) unsupported(path + ".multipleOf", "multipleOf together with minimum/maximum is not supported");
        const std::string name = cat("multiple-", ++n_);
        for (auto& [rule, body] : multiple_of_rules(int64_t(k), name)) rules_[rule] = body;
        return name;
      }
    }
    if (!bounded) return "json-integer";
    return add("integer", integer_range_gbnf(r));
  }

  static int64_t count(const json& s, const char* k, const std::string& path, int64_t dflt) {
    if (!s.contains(k)) return dflt;
    const json& v = s[k];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) fail(path, ".", k, ": must be a non-negative integer");
    if (v.get<int64_t>() > GrammarBuilder::kMaxRepeat) fail(path, ".", k, ": values above ", GrammarBuilder::kMaxRepeat, " are not supported");
    return v.get<int64_t>();
  }

  // A JSON string that is none of `names` (the declared properties: an additional property never
  // repeats one, as xgrammar has it): a trie over the names' code points, where a node may close the
  // string unless it spells a name, take a child's code point, or leave the trie for any string.
  // Names whose JSON text needs escapes are not excluded (their escaped spellings are many).
  std::string other_key(const std::set<std::string>& names) {
    std::vector<std::u32string> keys;
    for (const std::string& n : names) {
      std::u32string cps;
      bool plain = true;
      for (size_t i = 0; i < n.size() && plain;) {
        const unsigned char c = static_cast<unsigned char>(n[i]);
        const int len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        uint32_t cp = len == 1 ? c : c & (0x3F >> (len - 1));
        for (int k = 1; k < len && i + size_t(k) < n.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(n[i + size_t(k)]) & 0x3F);
        if (cp < 0x20 || cp == '"' || cp == '\\') plain = false;
        cps.push_back(cp);
        i += size_t(len);
      }
      if (plain && !cps.empty()) keys.push_back(cps);
    }
    if (keys.empty()) return "json-string";
    std::sort(keys.begin(), keys.end());
    rules_["json-rest"] = "json-char* \"\\\"\"";
    auto hexcp = [](uint32_t cp) {
      static const char* h = "0123456789ABCDEF";
      std::string e = "\\U";
      for (int i = 7; i >= 0; --i) e += h[(cp >> (4 * i)) & 15];
      return e;
    };
    // node(prefix): the rule for the rest of a key that has spelled `prefix` so far.
    std::function<std::string(const std::u32string&)> node = [&](const std::u32string& prefix) {
      std::vector<uint32_t> kids;
      bool is_name = false;
      for (const auto& k : keys) {
        if (k.size() < prefix.size() || k.compare(0, prefix.size(), prefix) != 0) continue;
        if (k.size() == prefix.size()) is_name = true;
        else if (kids.empty() || kids.back() != k[prefix.size()]) kids.push_back(k[prefix.size()]);
      }
      std::string body = is_name ? "" : "\"\\\"\" | ";
      std::string cls = "[^\"\\\\\\x00-\\x1F";
      for (uint32_t c : kids) cls += hexcp(c);
      body += cls + "] json-rest | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4}) json-rest";
      for (uint32_t c : kids) body += " | [" + hexcp(c) + "] " + node(prefix + std::u32string(1, c));
      return add("key", body);
    };
    return "\"\\\"\" " + node(U"");
  }

  std::string object(const json& s, const std::string& path, int depth) {
    std::vector<std::pair<std::string, std::string>> props;  // key literal, value rule
    std::vector<bool> req;
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) unsupported(path + ".required", "must be an array of strings");
      for (const json& r : s["required"]) {
        if (!r.is_string()) unsupported(path + ".required", "must be an array of strings");
        required.insert(r.get<std::string>());
      }
    }
    std::set<std::string> seen;
    if (s.contains("properties")) {
      const json& p = s["properties"];
      if (!p.is_object()) unsupported(path + ".properties", "must be an object");
      for (auto it = p.begin(); it != p.end(); ++it) {
        seen.insert(it.key());
        if (it.value() == json(false)) {  // the property must be absent (and is no additional property either)
          if (required.count(it.key())) unsupported(path + ".properties." + it.key(), "is required but its schema is 'false'");
          continue;
        }
        const std::string key = gbnf_literal(json(it.key()).dump(-1, ' ', false));
        props.push_back({key, visit(it.value(), path + ".properties." + it.key(), depth + 1)});
        req.push_back(required.count(it.key()) > 0);
      }
    }
    for (const std::string& r : required)
      if (!seen.count(r)) unsupported(path + ".required", cat("'", r.substr(0, 40), "' is required but not in properties"));
    std::string extra;  // the value rule of additional properties; empty: none allowed
    if (s.contains("additionalProperties")) {
      const json& a = s["additionalProperties"];
      if (!(a.is_boolean() && !a.get<bool>())) extra = visit(a, path + ".additionalProperties", depth + 1);
    } else if (!o_.strict) {
      extra = any_value_rules();
    }
    const std::string open = ws_.empty() ? "\"{\"" : "\"{\" ws", close = ws_.empty() ? "\"}\"" : "ws \"}\"";
    const size_t n = props.size();
    std::vector<std::string> kv(n);
    for (size_t i = 0; i < n; ++i) kv[i] = props[i].first + " " + colon_ + " " + props[i].second;
    const std::string kv_extra = extra.empty() ? "" : add("member", other_key(seen) + " " + colon_ + " " + extra);
    // after[i]: properties i… when one has been written (each preceded by a comma); first[i]: when
    // none has been.
    std::vector<std::string> after(n + 1), first(n + 1);
    after[n] = kv_extra.empty() ? "" : add("more", cat("(", comma_, " ", kv_extra, ")*"));
    first[n] = kv_extra.empty() ? "" : add("first", cat("(", kv_extra, " ", after[n], ")?"));
    for (size_t i = n; i-- > 0;) {
      const std::string rest_after = after[i + 1].empty() ? "" : " " + after[i + 1];
      const std::string with = kv[i] + rest_after;
      after[i] = add("after", cat(req[i] ? "" : "(", comma_, " ", kv[i], req[i] ? "" : ")?", rest_after));
      first[i] = add("first", req[i] || first[i + 1].empty() ? (req[i] ? with : "(" + with + ")?") : with + " | " + first[i + 1]);
    }
    return add("object", open + (first[0].empty() ? "" : " " + first[0]) + " " + close);
  }
};

}  // namespace

std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema, const JsonGrammarOptions& opt) {
  return Converter(schema, opt).run();
}

std::string json_object_gbnf(const JsonGrammarOptions& opt) {
  nlohmann::ordered_json none;
  return Converter(none, opt).any_object();
}

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, const JsonGrammarOptions& opt) {
  return parse_gbnf(json_schema_to_gbnf(schema, opt));
}

}  // namespace kd::grammar
