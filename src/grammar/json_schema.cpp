#include "grammar/json_schema.h"

// GCC 12 reports -Wrestrict on std::string concatenation at -O3 (a false positive, GCC bug 105329).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/gbnf.h"
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
      static const std::set<std::string> known = {"type", "properties", "required", "additionalProperties", "enum",
                                                  "const", "items", "prefixItems", "minItems", "maxItems", "anyOf",
                                                  "oneOf", "allOf", "$ref", "minLength", "maxLength", "pattern"};
      const std::string& k = it.key();
      if (known.count(k) || annotations().count(k) || k.rfind("x-", 0) == 0) continue;
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
    if (s.contains("const")) return gbnf_literal(serialize(s["const"], o_));
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) unsupported(path + ".enum", "must be a non-empty array");
      std::string alts;
      for (const json& v : e) alts += (alts.empty() ? "" : " | ") + gbnf_literal(serialize(v, o_));
      return add("enum", alts);
    }
    for (const char* k : {"anyOf", "oneOf"})
      if (s.contains(k)) {
        const json& a = s[k];
        if (!a.is_array() || a.empty()) unsupported(path + "." + k, "must be a non-empty array");
        json base = s;
        base.erase(k);
        std::string alts;
        for (size_t i = 0; i < a.size(); ++i) {
          // Keywords beside anyOf apply to every branch (JSON Schema's "and").
          json branch = a[i];
          if (branch.is_object())
            for (auto it = base.begin(); it != base.end(); ++it)
              if (!annotations().count(it.key()) && !branch.contains(it.key())) branch[it.key()] = it.value();
          alts += (alts.empty() ? "" : " | ") + visit(branch, cat(path, ".", k, "[", i, "]"), depth + 1);
        }
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
      // No type: the keywords present say which kinds they constrain.
      if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) types.push_back("object");
      if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems")) types.push_back("array");
      if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern")) types.push_back("string");
      if (types.empty()) return any_value_rules();
      if (types.size() > 1) unsupported(path, "keywords of several types without a 'type' are not supported");
    }
    std::string alts;
    for (const std::string& t : types) alts += (alts.empty() ? "" : " | ") + visit_type(s, t, path, depth);
    return types.size() == 1 ? alts : add("types", alts);
  }

  std::string visit_type(const json& s, const std::string& t, const std::string& path, int depth) {
    basic_rules();
    auto only = [&](std::initializer_list<const char*> allowed) {
      static const std::set<std::string> typed = {"properties", "required", "additionalProperties", "items", "prefixItems",
                                                  "minItems", "maxItems", "minLength", "maxLength", "pattern"};
      for (auto it = s.begin(); it != s.end(); ++it) {
        if (!typed.count(it.key())) continue;
        bool ok = false;
        for (const char* a : allowed) ok = ok || it.key() == a;
        if (!ok && s.contains("type") && s["type"].is_string())
          unsupported(path + "." + it.key(), cat("does not apply to type '", t, "'"));
      }
    };
    if (t == "null") return "json-null";
    if (t == "boolean") return "json-boolean";
    if (t == "integer") return only({}), "json-integer";
    if (t == "number") return only({}), "json-number";
    if (t == "string") {
      only({"minLength", "maxLength", "pattern"});
      if (s.contains("pattern")) {
        if (s.contains("minLength") || s.contains("maxLength"))
          unsupported(path + ".pattern", "pattern together with minLength/maxLength is not supported");
        if (!s["pattern"].is_string()) unsupported(path + ".pattern", "must be a string");
        return add("pattern", "\"\\\"\" " + regex_to_gbnf(s["pattern"].get<std::string>(), true, path + ".pattern") + " \"\\\"\"");
      }
      const int64_t lo = count(s, "minLength", path, 0), hi = count(s, "maxLength", path, -1);
      if (hi >= 0 && hi < lo) unsupported(path + ".maxLength", "is below minLength");
      if (lo == 0 && hi < 0) return "json-string";
      return add("string", cat("\"\\\"\" json-char{", lo, ",", hi < 0 ? std::string() : std::to_string(hi), "} \"\\\"\""));
    }
    if (t == "array") {
      only({"items", "prefixItems", "minItems", "maxItems"});
      const int64_t lo = count(s, "minItems", path, 0), hi = count(s, "maxItems", path, -1);
      if (hi >= 0 && hi < lo) unsupported(path + ".maxItems", "is below minItems");
      std::vector<std::string> prefix;
      if (s.contains("prefixItems")) {
        const json& p = s["prefixItems"];
        if (!p.is_array()) unsupported(path + ".prefixItems", "must be an array");
        for (size_t i = 0; i < p.size(); ++i) prefix.push_back(visit(p[i], cat(path, ".prefixItems[", i, "]"), depth + 1));
        if (lo > int64_t(prefix.size()) || (hi >= 0 && hi < int64_t(prefix.size())))
          unsupported(path + ".minItems", "minItems/maxItems with prefixItems is supported only when they allow the whole prefix");
      }
      std::string item;
      bool more = true;
      if (s.contains("items")) {
        if (s["items"].is_boolean() && !s["items"].get<bool>()) more = false;
        else item = visit(s["items"], path + ".items", depth + 1);
      } else {
        item = any_value_rules();
      }
      const std::string open = ws_.empty() ? "\"[\"" : "\"[\" ws", close = ws_.empty() ? "\"]\"" : "ws \"]\"";
      std::string body;
      if (!prefix.empty()) {
        for (size_t i = 0; i < prefix.size(); ++i) body += (i ? " " + comma_ + " " : "") + prefix[i];
        const int64_t extra_hi = hi < 0 ? -1 : hi - int64_t(prefix.size());
        if (more && extra_hi != 0)
          body += cat(" (", comma_, " ", item, "){0,", extra_hi < 0 ? std::string() : std::to_string(extra_hi), "}");
        return add("array", open + " " + body + " " + close);
      }
      if (!more) {
        if (lo > 0) unsupported(path + ".minItems", "is above 0 but items is false");
        return add("array", open + " " + close);
      }
      // lo ≥ 1: the first item, then lo − 1 … hi − 1 more; lo = 0: that, optional.
      const std::string tail_hi = hi < 0 ? std::string() : std::to_string(hi - 1);
      const std::string nonempty = cat(item, " (", comma_, " ", item, "){", lo > 0 ? lo - 1 : 0, ",", tail_hi, "}");
      if (hi == 0) return add("array", open + " " + close);
      return add("array", open + " " + (lo > 0 ? nonempty : "(" + nonempty + ")?") + " " + close);
    }
    if (t == "object") {
      only({"properties", "required", "additionalProperties"});
      return object(s, path, depth);
    }
    unsupported(path + ".type", cat("unknown type '", t.substr(0, 40), "'"));
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
        const std::string key = gbnf_literal(json(it.key()).dump(-1, ' ', false));
        props.push_back({key, visit(it.value(), path + ".properties." + it.key(), depth + 1)});
        req.push_back(required.count(it.key()) > 0);
        seen.insert(it.key());
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
