// strata plot METRICS.jsonl [-o FILE.png|FILE.svg]: the dashboard's panels for a finished run,
// drawn by gnuplot from the run's metrics file (read through the same RunBoard the live dashboard
// uses, so the panels hold the same figures).
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "launcher/command_util.h"
#include "launcher/commands.h"
#include "launcher/flags.h"
#include "web/run_board.h"

namespace strata::launcher {
namespace {

const std::vector<FlagSpec>& PlotFlags() {
  static const std::vector<FlagSpec> specs = {
      {"out", "the image to write (-o): .png or .svg (default: METRICS with .png for .jsonl)"},
      {"title", "the figure's title (default: the metrics file's name)"},
  };
  return specs;
}

// Every line of the file into a board; a line that is not a step is an error naming its line.
StatusOr<web::RunBoard::Snapshot> ReadRun(const std::string& path, const std::string& title) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrFormat("cannot open the metrics file '%s'", path));
  }
  web::RunBoard board(title, 0, SIZE_MAX);  // every step
  int line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.empty()) continue;
    if (Status s = board.AddStepLine(line); !s.ok()) {
      // A run killed while writing leaves its last line cut (no newline): that line is left out.
      if (in.eof()) {
        std::fprintf(stderr,
                     "strata plot: %s:%d is cut short (a run stopped while writing it); "
                     "plotting the steps before it\n",
                     path.c_str(), line_number);
        break;
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s:%d: %s (a metrics file holds one JSON object per step, as --metrics-out writes)",
          path, line_number, s.message()));
    }
  }
  web::RunBoard::Snapshot run = board.Take();
  if (run.points.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("'%s' holds no step: nothing to plot", path));
  }
  return run;
}

// The data files gnuplot reads, in `dir`: steps.dat (step, loss, tokens/s, lr, evaluated loss or
// NaN, stall ms or NaN, device and host hit ratios), load.dat (the load map: one row per expert
// of each layer, layers one after another, one column per bucket of steps).
Status WriteData(const web::RunBoard::Snapshot& run, const std::string& dir) {
  std::ofstream steps(dir + "/steps.dat");
  for (const web::RunBoard::Point& p : run.points) {
    const bool tiered = p.stall_ms >= 0;
    steps << absl::StrFormat("%d %.9g %.9g %.9g %s %s %s %s\n", p.step, p.loss, p.tokens_per_s,
                             p.lr, p.eval_loss >= 0 ? absl::StrFormat("%.9g", p.eval_loss) : "NaN",
                             tiered ? absl::StrFormat("%.9g", p.stall_ms) : "NaN",
                             tiered ? absl::StrFormat("%.9g", p.device_hit_ratio) : "NaN",
                             tiered ? absl::StrFormat("%.9g", p.host_hit_ratio) : "NaN");
  }
  std::ofstream load(dir + "/load.dat");
  const web::RunBoard::LoadMap& m = run.load;
  for (size_t l = 0; l < m.blocks.size(); ++l) {
    const size_t columns = m.sums[l].size();
    std::vector<std::vector<double>> by_column;
    for (size_t c = 0; c < columns; ++c) by_column.push_back(m.Column(l, c));
    const size_t experts = columns > 0 ? by_column[0].size() : 0;
    for (size_t e = 0; e < experts; ++e) {
      for (size_t c = 0; c < columns; ++c) {
        load << absl::StrFormat("%s%.4g", c ? " " : "", by_column[c][e]);
      }
      load << "\n";
    }
  }
  if (!steps || !load) {
    return absl::InternalError(absl::StrFormat("cannot write gnuplot's data in %s", dir));
  }
  return absl::OkStatus();
}

// A gnuplot string that is only text: single-quoted (gnuplot expands backquotes everywhere else,
// running them as commands), a quote doubled.
std::string Quoted(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

// The gnuplot script: four panels in two rows, as the dashboard lays them out.
std::string Script(const web::RunBoard::Snapshot& run, const std::string& dir,
                   const std::string& out, bool svg) {
  bool tiered = false, evaluated = false;
  for (const web::RunBoard::Point& p : run.points) {
    tiered |= p.stall_ms >= 0;
    evaluated |= p.eval_loss >= 0;
  }
  const std::string steps = Quoted(dir + "/steps.dat");
  std::string s;
  absl::StrAppend(&s, svg ? "set terminal svg size 1400,1000 dynamic font 'sans,11'\n"
                          : "set terminal pngcairo size 1400,1000 font 'sans,10'\n");
  absl::StrAppend(&s, "set output ", Quoted(out), "\n");
  absl::StrAppend(&s, "set multiplot layout 2,2 title ", Quoted(run.job), " noenhanced\n");
  absl::StrAppend(&s, "set grid; set key top right; set xlabel 'step'\n");
  // Loss.
  absl::StrAppend(&s, "set title 'Loss (nats per token)'\n");
  absl::StrAppend(&s, "plot ", steps, " using 1:2 with lines lc rgb '#2f6fdf' title 'training'");
  if (evaluated) {
    absl::StrAppend(&s, ", ", steps,
                    " using 1:5 with points pt 7 ps 0.8 lc rgb '#d9822b' title 'held-out'");
  }
  absl::StrAppend(&s, "\n");
  // Tokens/s and the learning rate.
  absl::StrAppend(&s, "set title 'Tokens per second and learning rate'\n");
  absl::StrAppend(&s, "set y2tics; set ytics nomirror\n");
  absl::StrAppend(
      &s, "plot ", steps, " using 1:3 with lines lc rgb '#2e9e5b' title 'tokens/s', ", steps,
      " using 1:4 axes x1y2 with lines lc rgb '#8a5cc7' title 'learning rate (right)'\n");
  absl::StrAppend(&s, "unset y2tics; set ytics mirror\n");
  // The load map.
  absl::StrAppend(&s, absl::StrFormat(
                          "set title 'Expert load over the mean (rows: experts of MoE blocks %s; "
                          "columns: %d steps each)'\n",
                          [&] {
                            std::string b;
                            for (size_t i = 0; i < run.load.blocks.size(); ++i) {
                              absl::StrAppend(&b, i ? ", " : "", run.load.blocks[i]);
                            }
                            return b;
                          }(),
                          run.load.bucket_steps));
  if (!run.load.blocks.empty() && !run.load.sums[0].empty()) {
    absl::StrAppend(&s, "set xlabel 'column'; set ylabel 'expert'; unset key\n");
    absl::StrAppend(&s,
                    "set palette defined (0 '#2f6fdf', 1 'white', 2 '#c0392b'); "
                    "set cbrange [0:2]; set yrange [*:*] reverse; set autoscale fix\n");
    absl::StrAppend(&s, "plot ", Quoted(dir + "/load.dat"), " matrix with image\n");
    absl::StrAppend(&s,
                    "set yrange [*:*] noreverse; set autoscale; unset ylabel; "
                    "set xlabel 'step'; set key\n");
  } else {
    absl::StrAppend(&s, "set label 1 'no MoE layer' at graph 0.4, 0.5 noenhanced\n",
                    "plot [0:1] [0:1] -1 notitle\nunset label 1\n");
  }
  // The tiers.
  if (tiered) {
    absl::StrAppend(&s, "set title 'Tiered store'\nset y2tics; set ytics nomirror\n");
    absl::StrAppend(
        &s, "plot ", steps, " using 1:6 with lines lc rgb '#c0392b' title 'stall ms per step', ",
        steps,
        " using 1:7 axes x1y2 with lines lc rgb '#2e9e5b' title 'device hit ratio (right)', ",
        steps, " using 1:8 axes x1y2 with lines lc rgb '#d9822b' title 'host hit ratio (right)'\n");
  } else {
    // Nothing to draw: an empty frame with a note (a constant outside the range draws nothing).
    absl::StrAppend(&s,
                    "set title 'Tiered store'\nset label 1 'experts in memory (IN_MEMORY)' "
                    "at graph 0.3, 0.5 noenhanced\nplot [0:1] [0:1] -1 notitle\n");
  }
  absl::StrAppend(&s, "unset multiplot\n");
  return s;
}

// Runs gnuplot on the script file (its errors name the line), without a shell; its output goes
// into the error when it fails.
Status RunGnuplot(const std::string& script_path) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("cannot run gnuplot: no pipe");
  const pid_t pid = fork();
  if (pid < 0) {
    close(out[0]);
    close(out[1]);
    return absl::InternalError("cannot run gnuplot: fork failed");
  }
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(out[1], STDERR_FILENO);
    execlp("gnuplot", "gnuplot", script_path.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  std::string output;
  char buf[4096];
  for (ssize_t n; (n = read(out[0], buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    output.append(buf, static_cast<size_t>(n));
  }
  close(out[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 127) {
    return absl::FailedPreconditionError(
        "strata plot draws with gnuplot, which is not installed: scripts/install-deps.sh "
        "installs it (Debian's gnuplot-nox)");
  }
  if (code != 0) {
    return absl::InternalError(absl::StrCat("gnuplot failed (exit ", code, "): ", output));
  }
  return absl::OkStatus();
}

}  // namespace

int PlotCommand(const std::vector<std::string>& args) {
  if (WantsHelp(args) || args.empty()) {
    std::fprintf(args.empty() ? stderr : stdout,
                 "usage: strata plot METRICS.jsonl [-o FILE.png|FILE.svg] [--title T]\n"
                 "Draws a run's metrics file (--metrics-out) as the dashboard's panels: loss and "
                 "held-out loss, tokens/s and learning rate, the expert-load map, the tiers.\n%s",
                 Flags::Usage(PlotFlags()).c_str());
    return args.empty() ? 2 : 0;
  }
  const std::string in = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  for (std::string& a : rest) {
    if (a == "-o") a = "--out";
  }
  auto flags = Flags::Parse("plot", PlotFlags(), rest);
  if (!flags.ok()) return UsageError(flags.status(), "plot", PlotFlags());
  std::string out = flags->String("out").value_or("");
  if (out.empty()) {
    out = absl::EndsWith(in, ".jsonl") ? in.substr(0, in.size() - 6) + ".png" : in + ".png";
  }
  // Absolute: gnuplot takes an output name that starts with '|' as a command to pipe to.
  std::error_code absolute_error;
  out = std::filesystem::absolute(out, absolute_error).string();
  const bool svg = absl::EndsWith(out, ".svg");
  if (!svg && !absl::EndsWith(out, ".png")) {
    return UsageError(
        absl::InvalidArgumentError(absl::StrFormat("-o '%s': the image is .png or .svg", out)),
        "plot", PlotFlags());
  }
  auto run =
      ReadRun(in, flags->String("title").value_or(std::filesystem::path(in).filename().string()));
  if (!run.ok()) return Fail(run.status());

  const char* base = std::getenv("TMPDIR");
  std::string dir = std::string(base && *base ? base : "/tmp") + "/strata-plot-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    return Fail(absl::PermissionDeniedError(absl::StrFormat("cannot create a folder %s", dir)));
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir};
  const std::string tmp_out = out + ".tmp";
  Status s = WriteData(*run, dir);
  if (s.ok()) {
    std::ofstream script(dir + "/plot.gp");
    script << Script(*run, dir, tmp_out, svg);
    if (!script) s = absl::InternalError("cannot write the gnuplot script");
  }
  if (s.ok()) s = RunGnuplot(dir + "/plot.gp");
  std::error_code ec;
  if (s.ok()) {
    std::filesystem::rename(tmp_out, out, ec);
    if (ec) s = absl::InternalError(absl::StrFormat("cannot write '%s': %s", out, ec.message()));
  }
  if (!s.ok()) {
    std::filesystem::remove(tmp_out, ec);
    return Fail(s);
  }
  std::printf("%s: %zu steps (%d to %d) -> %s\n", in.c_str(), run->points.size(),
              static_cast<int>(run->points.front().step), static_cast<int>(run->points.back().step),
              out.c_str());
  return 0;
}

}  // namespace strata::launcher
