// `modelcache ring` (RunRing, and the binary for the command line's own
// errors): the owner listing agrees with the ring, --kill lists exactly the
// models that move, the model files it reads, and the failure contract: exit
// status 1, nothing on stdout, one line on stderr starting with "error:".
#include "ring_command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "modelcache/replay/ring.h"

namespace modelcache::tools {
namespace {

using replay::ConsistentHashRing;
using replay::HaproxySampleKey;
using replay::MapBasedHash;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kNodes[] = "n1:1:100,n2:2:100,n3:3:50,n4:17:200";

struct Result {
  int status;
  std::string out;
  std::string err;
};

Result Ring(const RingFlags& flags) {
  std::ostringstream out, err;
  const int status = RunRing(flags, out, err);
  return {status, out.str(), err.str()};
}

std::vector<std::vector<std::string>> Rows(const std::string& csv) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(csv);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields;
    std::istringstream fs(line);
    for (std::string f; std::getline(fs, f, ',');) fields.push_back(f);
    rows.push_back(fields);
  }
  return rows;
}

class RingCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/ring_command_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  std::string ModelList(int n) {
    std::string text;
    for (int i = 0; i < n; ++i) text += "model-" + std::to_string(i) + "\n";
    return Write("models.txt", text);
  }

  // Checks the failure contract and returns the message.
  std::string ExpectError(const RingFlags& flags) {
    const Result r = Ring(flags);
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, StartsWith("error: "));
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    return r.err;
  }

  std::filesystem::path dir_;
};

TEST_F(RingCommandTest, PrintsEachModelsOwnerOnTheRing) {
  const Result r = Ring({.nodes = kNodes, .models = ModelList(300)});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const auto rows = Rows(r.out);
  ASSERT_EQ(rows.size(), 301u);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"model", "node"}));
  const ConsistentHashRing ring(ParseNodeList(kNodes));
  std::map<std::string, int> share;
  for (int i = 0; i < 300; ++i) {
    const std::string model = "model-" + std::to_string(i);
    ASSERT_EQ(rows[i + 1].size(), 2u);
    EXPECT_EQ(rows[i + 1][0], model);
    EXPECT_EQ(rows[i + 1][1],
              ring.server(ring.Owner(HaproxySampleKey(model, true))).name);
    ++share[rows[i + 1][1]];
  }
  // Every node owns some: the ring is not degenerate.
  EXPECT_EQ(share.size(), 4u);
}

TEST_F(RingCommandTest, KillListsExactlyTheKilledNodesModels) {
  const std::string models = ModelList(300);
  const Result owners = Ring({.nodes = kNodes, .models = models});
  const Result moved =
      Ring({.nodes = kNodes, .models = models, .kill = {"n2"}});
  ASSERT_EQ(moved.status, 0) << moved.err;
  const auto owner_rows = Rows(owners.out);
  const auto moved_rows = Rows(moved.out);
  EXPECT_EQ(moved_rows[0], (std::vector<std::string>{"model", "from", "to"}));
  std::map<std::string, std::string> owner;
  for (size_t i = 1; i < owner_rows.size(); ++i) {
    owner[owner_rows[i][0]] = owner_rows[i][1];
  }
  ConsistentHashRing ring(ParseNodeList(kNodes));
  ring.SetDown(ring.IndexOf("n2"));
  size_t expected = 0;
  for (const auto& [model, node] : owner) expected += node == "n2";
  ASSERT_GT(expected, 0u);
  ASSERT_EQ(moved_rows.size(), expected + 1);
  for (size_t i = 1; i < moved_rows.size(); ++i) {
    const auto& row = moved_rows[i];
    ASSERT_EQ(row.size(), 3u);
    EXPECT_EQ(row[1], "n2");
    EXPECT_EQ(owner[row[0]], "n2");
    EXPECT_EQ(row[2],
              ring.server(ring.Owner(HaproxySampleKey(row[0], true))).name);
    EXPECT_NE(row[2], "n2");
  }
}

TEST_F(RingCommandTest, KillingTwoNodesMovesBoth) {
  const Result moved =
      Ring({.nodes = kNodes, .models = ModelList(300), .kill = {"n2", "n4"}});
  ASSERT_EQ(moved.status, 0) << moved.err;
  for (const auto& row : Rows(moved.out)) {
    if (row[0] == "model") continue;
    EXPECT_TRUE(row[1] == "n2" || row[1] == "n4") << row[0];
    EXPECT_TRUE(row[2] == "n1" || row[2] == "n3") << row[0];
  }
}

TEST_F(RingCommandTest, MapBasedMovesModelsOfOtherNodesToo) {
  const std::string models = ModelList(300);
  const Result r =
      Ring({.nodes = kNodes, .models = models, .hash_type = "map-based"});
  ASSERT_EQ(r.status, 0) << r.err;
  MapBasedHash map(ParseNodeList(kNodes));
  const auto rows = Rows(r.out);
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i][1],
              map.server(map.Select(HaproxySampleKey(rows[i][0], false))).name);
  }
  const Result moved = Ring({.nodes = kNodes,
                             .models = models,
                             .kill = {"n2"},
                             .hash_type = "map-based"});
  ASSERT_EQ(moved.status, 0) << moved.err;
  bool other_node_moved = false;
  for (const auto& row : Rows(moved.out)) {
    if (row[0] != "model" && row[1] != "n2") other_node_moved = true;
  }
  EXPECT_TRUE(other_node_moved);
}

TEST_F(RingCommandTest, HashTypesFollowHaproxysDefaults) {
  EXPECT_TRUE(ParseHashType("consistent").avalanche);
  EXPECT_FALSE(ParseHashType("consistent sdbm").avalanche);
  EXPECT_TRUE(ParseHashType("consistent sdbm avalanche").avalanche);
  EXPECT_FALSE(ParseHashType("map-based").avalanche);
  EXPECT_FALSE(ParseHashType("map-based").consistent);
  EXPECT_TRUE(ParseHashType("map-based sdbm avalanche").avalanche);
  const Result r = Ring({.nodes = kNodes,
                         .models = ModelList(50),
                         .hash_type = "consistent sdbm"});
  ASSERT_EQ(r.status, 0) << r.err;
  const ConsistentHashRing ring(ParseNodeList(kNodes));
  const auto rows = Rows(r.out);
  for (size_t i = 1; i < rows.size(); ++i) {
    EXPECT_EQ(
        rows[i][1],
        ring.server(ring.Owner(HaproxySampleKey(rows[i][0], false))).name);
  }
}

TEST_F(RingCommandTest, ReadsTheModelColumnOfATraceOnceEach) {
  const std::string trace = Write("trace.csv",
                                  "t_ms,model,size_bytes\n"
                                  "0,b,10\n"
                                  "5, a ,20\n"
                                  "\n"
                                  "9,b,10\n"
                                  "12,\"c,d\",3\n");
  EXPECT_EQ(ReadModelIds(trace), (std::vector<std::string>{"b", "a", "c,d"}));
  const Result r = Ring({.nodes = kNodes, .models = trace});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\n\"c,d\","));
  const std::string sizes = Write("sizes.csv", "model,size_bytes\nx,1\ny,2\n");
  EXPECT_EQ(ReadModelIds(sizes), (std::vector<std::string>{"x", "y"}));
  const std::string plain = Write("plain.txt", "x\r\n  y\t\nx\n\nz%2Fw\n");
  EXPECT_EQ(ReadModelIds(plain), (std::vector<std::string>{"x", "y", "z%2Fw"}));
  const std::string header_only = Write("h.txt", "model\nq\n");
  EXPECT_EQ(ReadModelIds(header_only), (std::vector<std::string>{"q"}));
}

TEST_F(RingCommandTest, BadNodeListsAreErrors) {
  const std::string models = ModelList(3);
  const auto error = [&](const std::string& nodes) {
    return ExpectError({.nodes = nodes, .models = models});
  };
  EXPECT_THAT(error("n1:1:1,n2:1:1"),
              HasSubstr("--nodes: server id 1 is used by 'n1' and 'n2'"));
  EXPECT_THAT(error("n1:1:1,n1:2:1"),
              HasSubstr("--nodes: server name 'n1' is used twice"));
  EXPECT_THAT(error("n1:1:0"), HasSubstr("weight 0, outside HAProxy's 1-256"));
  EXPECT_THAT(error("n1:1:257"),
              HasSubstr("weight 257, outside HAProxy's 1-256"));
  EXPECT_THAT(error("n1:0:1"), HasSubstr("id 0"));
  EXPECT_THAT(error("n1:2147483648:1"), HasSubstr("id 2147483648"));
  EXPECT_THAT(error("n1:99999999999999999999:1"), HasSubstr("is out of range"));
  EXPECT_THAT(error("n1:1"), HasSubstr("'n1:1' is not name:id:weight"));
  EXPECT_THAT(error("n1:1:1:1"), HasSubstr("is not name:id:weight"));
  EXPECT_THAT(error("n1:x:1"),
              HasSubstr("the id 'x' of 'n1:x:1' is not a whole number"));
  EXPECT_THAT(error("n1:1:-1"), HasSubstr("is not a whole number"));
  EXPECT_THAT(error("n1:1:1.5"), HasSubstr("is not a whole number"));
  EXPECT_THAT(error("n1:1:1,,n2:2:1"), HasSubstr("empty entry"));
  EXPECT_THAT(error("n1:1:1,"), HasSubstr("empty entry"));
  EXPECT_THAT(error(""), HasSubstr("--nodes: empty list"));
  EXPECT_THAT(error(":1:1"), HasSubstr("empty name"));
  EXPECT_THAT(error("n 1:1:1"), HasSubstr("may hold only letters"));
  EXPECT_THAT(error("a:5:1,b:1048581:1"),
              HasSubstr("would share their ring points"));
}

TEST_F(RingCommandTest, BadKillsHashTypesAndFilesAreErrors) {
  const std::string models = ModelList(3);
  EXPECT_THAT(ExpectError({.nodes = kNodes, .models = models, .kill = {"n9"}}),
              HasSubstr("--kill: no node named 'n9' in --nodes"));
  EXPECT_THAT(
      ExpectError(
          {.nodes = "a:1:1,b:2:1", .models = models, .kill = {"a", "b", "a"}}),
      HasSubstr("every node would be down"));
  for (const char* type :
       {"", "rendezvous", "consistent djb2", "consistent sdbm fast",
        "map-based sdbm avalanche x"}) {
    EXPECT_THAT(
        ExpectError({.nodes = kNodes, .models = models, .hash_type = type}),
        HasSubstr("--hash-type"))
        << type;
  }
  const auto file_error = [&](const std::string& path) {
    return ExpectError({.nodes = kNodes, .models = path});
  };
  EXPECT_THAT(file_error((dir_ / "missing").string()),
              HasSubstr("cannot open file"));
  EXPECT_THAT(file_error(dir_.string()), HasSubstr("is a directory"));
  EXPECT_THAT(file_error(Write("empty", "")), HasSubstr(":1: no model ids"));
  EXPECT_THAT(file_error(Write("blank", "\n  \n")), HasSubstr("no model ids"));
  EXPECT_THAT(file_error(Write("nomodel.csv", "t_ms,name\n1,a\n")),
              HasSubstr(":1: a CSV header must name a 'model' column"));
  EXPECT_THAT(file_error(Write("short.csv", "t_ms,model\n1,a\n2\n")),
              HasSubstr(":3: expected at least 2 fields, found 1"));
  EXPECT_THAT(file_error(Write("slash", "a\norg/model\n")),
              HasSubstr(":2: model id 'org/model' cannot stand"));
  EXPECT_THAT(file_error(Write("space", "a b\n")),
              HasSubstr(":1: model id 'a b'"));
  EXPECT_THAT(file_error(Write("query", "a?x\n")),
              HasSubstr("percent-encoded"));
  EXPECT_THAT(file_error(Write("utf8", "caf\xc3\xa9\n")),
              HasSubstr("percent-encoded"));
  EXPECT_THAT(file_error(Write("ctl", "a\x01z\n")), HasSubstr("a\\x01z"));
  EXPECT_THAT(file_error(Write("emptyid.csv", "model,x\n,1\n")),
              HasSubstr(":2: empty model id"));
}

// The binary: the command line's own errors keep the contract, and a run
// prints what RunRing prints.
Result RunCli(const std::filesystem::path& dir, const std::string& args) {
  const std::string out_path = (dir / "cli_out").string();
  const std::string err_path = (dir / "cli_err").string();
  const std::string command = std::string(MODELCACHE_CLI) + " " + args + " >" +
                              out_path + " 2>" + err_path;
  const int raw = std::system(command.c_str());
  Result r{WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, "", ""};
  std::stringstream out, err;
  out << std::ifstream(out_path).rdbuf();
  err << std::ifstream(err_path).rdbuf();
  r.out = out.str();
  r.err = err.str();
  return r;
}

TEST_F(RingCommandTest, TheBinaryPrintsTheSameAndFailsWithOneErrorLine) {
  const std::string models = ModelList(40);
  const Result in_process = Ring({.nodes = kNodes, .models = models});
  const Result cli = RunCli(
      dir_, std::string("ring --nodes ") + kNodes + " --models " + models);
  EXPECT_EQ(cli.status, 0) << cli.err;
  EXPECT_EQ(cli.out, in_process.out);
  const Result killed =
      RunCli(dir_, std::string("ring --nodes ") + kNodes + " --models " +
                       models + " --kill n1,n3");
  EXPECT_EQ(
      killed.out,
      Ring({.nodes = kNodes, .models = models, .kill = {"n1", "n3"}}).out);
  for (const std::string& args :
       {std::string("ring --models ") + models,  // no --nodes
        std::string("ring --nodes a:1:1"),       // no --models
        std::string("ring --nodes a:1:1,a:2:1 --models ") + models,
        std::string("ring --nodes a:1:300 --models ") + models,
        std::string("ring --nodes a:1:1 --models ") + models + " --kill b"}) {
    const Result r = RunCli(dir_, args);
    EXPECT_EQ(r.status, 1) << args;
    EXPECT_EQ(r.out, "") << args;
    EXPECT_THAT(r.err, StartsWith("error: ")) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace modelcache::tools
