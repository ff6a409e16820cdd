//go:build release

package release

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// dist is GoReleaser's output, ../../dist unless WORKER_RELEASE_DIST names
// another.
func dist(t *testing.T) string {
	t.Helper()
	d := os.Getenv("WORKER_RELEASE_DIST")
	if d == "" {
		d = filepath.Join("..", "..", "dist")
	}
	if _, err := os.Stat(filepath.Join(d, "metadata.json")); err != nil {
		t.Fatalf("no GoReleaser output in %s (run scripts/release-check): %v", d, err)
	}
	return d
}

// snapshot is what GoReleaser says it built: metadata.json.
type snapshot struct {
	Version string `json:"version"`
	Commit  string `json:"commit"`
}

func readSnapshot(t *testing.T, dir string) snapshot {
	t.Helper()
	var s snapshot
	b, err := os.ReadFile(filepath.Join(dir, "metadata.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(s.Version, "-dev+") || len(s.Commit) != 40 {
		t.Fatalf("metadata.json: version %q, commit %q; want a snapshot version (-dev+<commit>) and a full commit", s.Version, s.Commit)
	}
	return s
}

// one returns the single file of dir matching pattern.
func one(t *testing.T, dir, pattern string) string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, pattern))
	if err != nil || len(m) != 1 {
		t.Fatalf("%s in %s: %v (%v), want exactly one", pattern, dir, m, err)
	}
	return m[0]
}

// The linux/amd64 archive holds the static binary and the documents, and
// the binary names the snapshot as a development build.
func TestReleaseSnapshotArchive(t *testing.T) {
	dir := dist(t)
	snap := readSnapshot(t, dir)
	files := untarGz(t, one(t, dir, "worker_*_linux_amd64.tar.gz"))
	root := "worker_" + snap.Version + "_linux_amd64/"
	for _, name := range []string{"worker", "LICENSE", "NOTICE", "README.md", "CHANGELOG.md", "SECURITY.md", "configs/worker.yaml"} {
		if _, ok := files[root+name]; !ok {
			t.Errorf("the archive lacks %s%s; it holds %v", root, name, slices.Sorted(maps.Keys(files)))
		}
	}
	for _, name := range []string{"LICENSE", "NOTICE", "CHANGELOG.md", "configs/worker.yaml"} {
		if want := readRepo(t, name); !bytes.Equal(files[root+name], want) {
			t.Errorf("the archive's %s differs from the repository's", name)
		}
	}
	bin := filepath.Join(t.TempDir(), "worker")
	if err := os.WriteFile(bin, files[root+"worker"], 0o755); err != nil {
		t.Fatal(err)
	}
	assertStatic(t, bin)

	out, err := exec.Command(bin, "version", "--output", "json").Output()
	if err != nil {
		t.Fatalf("worker version --output json: %v", err)
	}
	var v struct {
		Version     string `json:"version"`
		Revision    string `json:"revision"`
		BuildDate   string `json:"build_date"`
		Platform    string `json:"platform"`
		Development bool   `json:"development"`
	}
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatalf("worker version --output json: %v\n%s", err, out)
	}
	if v.Version != "v"+snap.Version || v.Revision != snap.Commit || v.Platform != "linux/amd64" || !v.Development {
		t.Errorf("worker version --output json = %+v; want version v%s, revision %s, platform linux/amd64, development", v, snap.Version, snap.Commit)
	}
	if built, err := time.Parse(time.RFC3339, v.BuildDate); err != nil || time.Since(built) > 24*time.Hour {
		t.Errorf("build_date %q: want an RFC 3339 time of this build (%v)", v.BuildDate, err)
	}
	text, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatalf("worker version: %v", err)
	}
	if first, _, _ := strings.Cut(string(text), "\n"); first != "worker v"+snap.Version+" (development build)" {
		t.Errorf("worker version says %q first, want %q", first, "worker v"+snap.Version+" (development build)")
	}
	t.Logf("worker version:\n%s", text)
}

// The .deb installs the binary, the configuration as a conffile (kept on
// upgrade), the systemd unit and the user it runs as, with the scripts
// that create the user.
func TestReleaseSnapshotDeb(t *testing.T) {
	dir := dist(t)
	members := readAr(t, one(t, dir, "worker_*_amd64.deb"))
	data := untarGz(t, members["data.tar.gz"])
	for _, name := range []string{"./usr/bin/worker", "./etc/worker/worker.yaml", "./etc/worker/worker.env",
		"./usr/lib/systemd/system/worker.service", "./usr/lib/sysusers.d/worker.conf",
		"./usr/share/doc/worker/LICENSE", "./usr/share/doc/worker/NOTICE"} {
		if _, ok := data[name]; !ok {
			t.Errorf("the .deb lacks %s; it holds %v", name, slices.Sorted(maps.Keys(data)))
		}
	}
	if !bytes.Equal(data["./usr/lib/systemd/system/worker.service"], readRepo(t, "packaging/systemd/worker.service")) {
		t.Error("the .deb's worker.service differs from packaging/systemd/worker.service")
	}
	if !bytes.Equal(data["./etc/worker/worker.yaml"], readRepo(t, "configs/worker.yaml")) {
		t.Error("the .deb's /etc/worker/worker.yaml differs from configs/worker.yaml")
	}
	control := untarGz(t, members["control.tar.gz"])
	conffiles := strings.Fields(string(control["./conffiles"]))
	for _, want := range []string{"/etc/worker/worker.yaml", "/etc/worker/worker.env"} {
		if !slices.Contains(conffiles, want) {
			t.Errorf("conffiles = %v; want %s there, so an upgrade keeps local changes", conffiles, want)
		}
	}
	if !bytes.Contains(control["./postinst"], []byte("systemd-sysusers")) {
		t.Errorf("the .deb's postinst does not create the worker user:\n%s", control["./postinst"])
	}
}

// The unit runs as its own user, is not restarted on the exit codes a
// restart cannot fix, and is hardened.
func TestReleaseSystemdUnit(t *testing.T) {
	unit := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(readRepo(t, "packaging/systemd/worker.service")))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			unit[k] = append(unit[k], v)
		}
	}
	for k, want := range map[string]string{
		"User": "worker", "Group": "worker", "Restart": "on-failure", "RestartPreventExitStatus": "64 72 78",
		"EnvironmentFile": "-/etc/worker/worker.env", "ExecStart": "/usr/bin/worker --config /etc/worker/worker.yaml run",
		"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
		"PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
		"ProtectControlGroups": "yes", "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX", "CapabilityBoundingSet": "",
	} {
		if !slices.Contains(unit[k], want) {
			t.Errorf("worker.service: %s=%v, want %q", k, unit[k], want)
		}
	}
	if got := string(readRepo(t, "packaging/sysusers.d/worker.conf")); !strings.Contains(got, "\nu worker ") {
		t.Errorf("sysusers.d/worker.conf declares no worker user:\n%s", got)
	}
}

// The .rpm holds the same files. Its header (not compressed) names them.
func TestReleaseSnapshotRPM(t *testing.T) {
	b, err := os.ReadFile(one(t, dist(t), "worker-*.x86_64.rpm"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte{0xed, 0xab, 0xee, 0xdb}) {
		t.Fatal("not an RPM: no lead magic")
	}
	for _, name := range []string{"worker.service", "worker.yaml", "worker.env", "worker.conf", "/etc/worker/", "/usr/bin/", "/usr/lib/systemd/system/"} {
		if !bytes.Contains(b, []byte(name+"\x00")) {
			t.Errorf("the .rpm's header does not name %s", name)
		}
	}
}

// The SBOM of the linux/amd64 archive is CycloneDX and lists pgx and River
// at the versions in go.mod.
func TestReleaseSnapshotSBOM(t *testing.T) {
	dir := dist(t)
	snap := readSnapshot(t, dir)
	var bom struct {
		BOMFormat string `json:"bomFormat"`
		Metadata  struct {
			Component struct{ Name, Version string } `json:"component"`
		} `json:"metadata"`
		Components []struct{ Name, Version, Purl string } `json:"components"`
	}
	b, err := os.ReadFile(one(t, dir, "worker_*_linux_amd64.cdx.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &bom); err != nil {
		t.Fatal(err)
	}
	if bom.BOMFormat != "CycloneDX" || bom.Metadata.Component.Name != "github.com/worker-dev/worker" || bom.Metadata.Component.Version != "v"+snap.Version {
		t.Errorf("SBOM: format %q, component %+v; want CycloneDX for github.com/worker-dev/worker v%s", bom.BOMFormat, bom.Metadata.Component, snap.Version)
	}
	gomod := string(readRepo(t, "go.mod"))
	for _, mod := range []string{"github.com/jackc/pgx/v5", "github.com/riverqueue/river"} {
		i := slices.IndexFunc(bom.Components, func(c struct{ Name, Version, Purl string }) bool { return c.Name == mod })
		if i < 0 {
			t.Errorf("the SBOM does not list %s", mod)
			continue
		}
		c := bom.Components[i]
		if !strings.Contains(gomod, "\t"+mod+" "+c.Version+"\n") || !strings.HasPrefix(c.Purl, "pkg:golang/"+mod+"@"+c.Version) {
			t.Errorf("the SBOM lists %s at %s (%s); go.mod requires another version", mod, c.Version, c.Purl)
		}
	}
}

// checksums.txt covers every archive, package and SBOM, with their right
// SHA-256.
func TestReleaseSnapshotChecksums(t *testing.T) {
	dir := dist(t)
	b, err := os.ReadFile(filepath.Join(dir, "checksums.txt"))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		sum, name, _ := strings.Cut(line, "  ")
		listed[name] = sum
	}
	for _, pattern := range []string{"*.tar.gz", "*.deb", "*.rpm", "*.cdx.json"} {
		m, _ := filepath.Glob(filepath.Join(dir, pattern))
		if len(m) == 0 {
			t.Errorf("no %s in %s", pattern, dir)
		}
		for _, path := range m {
			f, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			sum := sha256.Sum256(f)
			if got := listed[filepath.Base(path)]; got != hex.EncodeToString(sum[:]) {
				t.Errorf("checksums.txt has %q for %s, want %x", got, filepath.Base(path), sum)
			}
		}
	}
}

func assertStatic(t *testing.T, path string) {
	t.Helper()
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s is dynamically linked (it names an interpreter); want a static binary", path)
		}
	}
}

// readAr returns the members of a Debian package (an ar archive).
func readAr(t *testing.T, path string) map[string][]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte("!<arch>\n")) {
		t.Fatalf("%s is not an ar archive", path)
	}
	members := map[string][]byte{}
	for rest := b[8:]; len(rest) >= 60; {
		name := strings.TrimSuffix(strings.TrimSpace(string(rest[:16])), "/")
		var size int
		if _, err := fmt.Sscan(string(rest[48:58]), &size); err != nil || 60+size > len(rest) {
			t.Fatalf("%s: bad member header %q", path, rest[:60])
		}
		members[name] = rest[60 : 60+size]
		rest = rest[60+size+size%2:]
	}
	return members
}

// untarGz returns the regular files of a .tar.gz, given as a path or as
// its bytes, by name.
func untarGz[T string | []byte](t *testing.T, src T) map[string][]byte {
	t.Helper()
	var raw []byte
	switch s := any(src).(type) {
	case string:
		b, err := os.ReadFile(s)
		if err != nil {
			t.Fatal(err)
		}
		raw = b
	case []byte:
		raw = s
	}
	zr, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			files[h.Name] = b
		}
	}
}

func readRepo(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}
