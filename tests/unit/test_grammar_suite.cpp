// The official JSON-Schema-Test-Suite (Debian package json-schema-test-suite 2.0.0, installed by
// scripts/install-deps; KDTREE_JSON_SCHEMA_SUITE overrides the folder) against the JSON Schema
// front end: an independent statement of what every keyword means, schema by schema.
//
// For each schema the front end compiles (strict = false: JSON Schema's own defaults), every
// "valid": true instance must be in the grammar's language (some spelling of it: tests/
// grammar_accepts.h tries every key order) and every "valid": false one must not. A schema it
// refuses must be refused with an error that names a JSON path ("$…"), as the server's 400 does.
// The optional format files are checked one way only: the formats are RFC subsets (json_format.h),
// so an instance the grammar accepts must be valid, while some valid ones are outside the subset.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/json_schema.h"
#include "grammar_accepts.h"

namespace {

namespace fs = std::filesystem;
namespace g = kd::grammar;
using ojson = nlohmann::ordered_json;

fs::path suite_dir() {
  if (const char* e = std::getenv("KDTREE_JSON_SCHEMA_SUITE")) return e;
  return "/usr/share/json-schema-test-suite/tests";
}

struct Counts {
  int schemas = 0, supported = 0, refused = 0, instances = 0, passed = 0;
};

// Runs one file; `one_way`: only accepted ⇒ valid is asserted.
void run_file(const fs::path& file, bool one_way, Counts& c) {
  std::ifstream in(file);
  const ojson groups = ojson::parse(in);
  for (const ojson& group : groups) {
    ++c.schemas;
    const std::string where = file.parent_path().filename().string() + "/" + file.filename().string() + ": " +
                              group["description"].get<std::string>();
    g::JsonGrammarOptions o;
    o.any_whitespace = false;
    o.strict = false;
    g::Grammar gr;
    try {
      gr = g::json_schema_grammar(group["schema"], o);
    } catch (const kd::Error& e) {
      ++c.refused;
      if (std::getenv("KDTREE_SUITE_VERBOSE")) std::cout << "[refused] " << where << ": " << e.what() << "\n";
      EXPECT_EQ(std::string(e.what()).rfind("$", 0), 0u) << where << ": the refusal names no JSON path: " << e.what();
      continue;
    }
    ++c.supported;
    for (const ojson& t : group["tests"]) {
      ++c.instances;
      const bool valid = t["valid"].get<bool>();
      const bool accepted = kd::test::accepts_value(gr, t["data"]);
      const bool ok = one_way ? (!accepted || valid) : accepted == valid;
      c.passed += ok;
      EXPECT_TRUE(ok) << where << " / " << t["description"].get<std::string>() << ": data " << t["data"].dump() << " is "
                      << (valid ? "valid" : "invalid") << " but the grammar " << (accepted ? "accepts" : "rejects") << " it";
    }
  }
}

TEST(GrammarSuite, OfficialJsonSchemaTestSuite) {
  const fs::path root = suite_dir();
  if (!fs::exists(root / "draft7")) GTEST_SKIP() << root << " is missing: install json-schema-test-suite (scripts/install-deps)";
  // The schemas compiled at the time of writing, per draft: fewer means a keyword regressed.
  const std::map<std::string, int> min_supported = {{"draft4", 44}, {"draft6", 55}, {"draft7", 55}};
  for (const char* draft : {"draft4", "draft6", "draft7"}) {
    Counts core, formats;
    std::map<std::string, bool> files;
    for (const auto& e : fs::directory_iterator(root / draft))
      if (e.path().extension() == ".json") files[e.path().string()] = false;
    if (fs::exists(root / draft / "optional" / "format"))
      for (const auto& e : fs::directory_iterator(root / draft / "optional" / "format")) files[e.path().string()] = true;
    if (fs::exists(root / draft / "optional" / "format.json")) files[(root / draft / "optional" / "format.json").string()] = true;
    for (const auto& [f, one_way] : files) run_file(f, one_way, one_way ? formats : core);
    std::cout << "[suite] " << draft << ": " << core.schemas << " schemas, " << core.supported << " compiled, " << core.refused
              << " refused with a path; " << core.passed << "/" << core.instances << " instances agree"
              << " | formats: " << formats.supported << " compiled, " << formats.refused << " refused; " << formats.passed << "/"
              << formats.instances << " never accept an invalid instance\n";
    EXPECT_GE(core.supported, min_supported.at(draft)) << draft;
  }
}

}  // namespace
