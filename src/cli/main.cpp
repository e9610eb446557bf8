// kdtree: the command line. Every subcommand shares this one parser and its conventions
// (llama.cpp flag names where one exists; --json for machine-readable output on stdout).
#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/commands.h"
#include "cli/int_flag.h"
#include "cli/quality_commands.h"
#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "core/untrusted.h"

int main(int argc, char** argv) {
  CLI::App app{"kdtree " KDTREE_VERSION
               " — DeepSeek-V3 / Kimi K2 inference with DDTree speculative decoding.\n"
               "Point it at a HuggingFace checkpoint directory (config.json + *.safetensors)."};
  app.require_subcommand(1);
  app.fallthrough();  // global flags may follow the subcommand
  app.set_version_flag("--version", "kdtree " KDTREE_VERSION);
  int threads = 0;
  bool verbose = false, quiet = false;
  app.add_option("-t,--threads", threads, "CPU threads (default: all cores, or $KDTREE_THREADS)")
      ->transform(kd::cli::whole_number(threads))
      ->check(CLI::Range(1, 1024));
  app.add_flag("-v,--verbose", verbose, "More logging on stderr");
  app.add_flag("-q,--quiet", quiet, "No logging or progress on stderr (errors still print)");

  kd::cli::RunOptions run;
  kd::cli::InspectOptions inspect;
  kd::MakeModelOptions make;
  kd::cli::BenchOptions bench;
  kd::cli::TreeOptions tree;
  kd::cli::PlanBudgetOptions plan_budget;
  kd::cli::TokenizeOptions tokenize;
  kd::cli::ChatTemplateOptions chat_template;
  kd::cli::ServeOptions serve;
  kd::cli::QuantizeCliOptions quantize;
  kd::cli::PplCliOptions ppl;
  kd::cli::add_run(app, run);
  kd::cli::add_inspect(app, inspect);
  kd::cli::add_make_model(app, make);
  kd::cli::add_bench(app, bench);
  kd::cli::add_tree(app, tree);
  kd::cli::add_plan_budget(app, plan_budget);
  kd::cli::add_tokenize(app, tokenize);
  kd::cli::add_chat_template(app, chat_template);
  kd::cli::add_serve(app, serve);
  kd::cli::add_quantize(app, quantize);
  kd::cli::add_ppl(app, ppl);

  // Name an unknown command instead of CLI11's generic "a subcommand is required".
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    for (const auto* sub : app.get_subcommands({})) known |= sub->get_name() == argv[1];
    if (!known) {
      std::fprintf(stderr, "error: unknown command '%s' (commands: run, inspect, make-model, bench, tree, plan-budget, tokenize, chat-template, serve, quantize, ppl; see kdtree --help)\n", argv[1]);
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;  // usage errors exit 2, like most Unix tools
  }
  if (quiet) kd::set_log_level(kd::LogLevel::quiet);
  if (verbose) kd::set_log_level(kd::LogLevel::debug);
  if (threads > 0) kd::ThreadPool::set_global_threads(threads);
  try {
    if (app.got_subcommand("run")) return kd::cli::cmd_run(run);
    if (app.got_subcommand("inspect")) return kd::cli::cmd_inspect(inspect);
    if (app.got_subcommand("make-model")) return kd::cli::cmd_make_model(make);
    if (app.got_subcommand("bench")) return kd::cli::cmd_bench(bench);
    if (app.got_subcommand("tree")) return kd::cli::cmd_tree(tree);
    if (app.got_subcommand("plan-budget")) return kd::cli::cmd_plan_budget(plan_budget);
    if (app.got_subcommand("tokenize")) return kd::cli::cmd_tokenize(tokenize);
    if (app.got_subcommand("chat-template")) return kd::cli::cmd_chat_template(chat_template);
    if (app.got_subcommand("serve")) return kd::cli::cmd_serve(serve);
    if (app.got_subcommand("quantize")) return kd::cli::cmd_quantize(quantize);
    if (app.got_subcommand("ppl")) return kd::cli::cmd_ppl(ppl);
  } catch (const std::exception& e) {  // kd::Error, and the library's (bad_alloc, filesystem_error, …)
    // Messages quote names and values from files; whatever slipped through unescaped stops here.
    std::fprintf(stderr, "error: %s\n", kd::printable_message(e.what()).c_str());
    return 1;
  }
  return 0;
}
